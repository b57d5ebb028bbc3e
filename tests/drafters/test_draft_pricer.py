"""The EAGLE drafter under a `DraftPricer` (`TreeBudget.pricer`): a pricer decides how deep each row
drafts, never what a drafted tree holds up to there, never how it is verified."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moe_spec.core.drafting import TreeBudget
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.target import TargetModel
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.policy.static import StaticController
from moe_spec.testing.helpers import ALL_ARCHITECTURES, begun_eagle_drafter, hf_greedy, random_eagle_head, random_prompt
from moe_spec.testing.tiny_models import tiny_model

torch.set_num_threads(1)
GREEDY = SamplingConfig()


class StopAt:
    """Expands row b up to depth `depths[b]` (children there included), carrying each node's path
    product of q as its value; records what it was asked."""

    def __init__(self, depths, rule=None):
        self.depths = list(depths)
        self.rule = rule  # (depth, values [B, M]) -> [B] bool, instead of the fixed depths
        self.forwards = 0
        self.asked: list[tuple[int, np.ndarray]] = []

    def child_values(self, depth, parent_values, log_q):
        self.forwards += 1
        assert [len(row) for row in parent_values] == [len(row) for row in log_q]
        return [[value * math.exp(child) for value, children in zip(parents, rows) for child in children]
                for parents, rows in zip(parent_values, log_q)]

    def worth_expanding(self, depth, values):
        values = np.array(values)  # [B, M]
        self.asked.append((depth, values))
        if self.rule is not None:
            return self.rule(depth, values).tolist()
        return [depth <= d for d in self.depths]


_prompt, _begun = random_prompt, begun_eagle_drafter


def _same(a, b) -> bool:
    return torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) and torch.allclose(a.scores, b.scores)


@pytest.fixture(scope="module")
def pair():
    target = TargetModel(tiny_model("qwen3_moe"))
    return target, random_eagle_head(target)


def test_a_pricer_that_expands_everything_changes_no_tree(pair):
    target, head = pair
    prompt = _prompt()
    budget = TreeBudget(12, 4, 4)
    plain = _begun(target, head, prompt).propose([int(prompt[-1])], budget, [4], GREEDY)[0]
    pricer = StopAt([99])
    drafter = _begun(target, head, prompt)
    runs = []
    draft = drafter._runner.draft
    drafter._runner.draft = lambda *args, **kwargs: runs.append(1) or draft(*args, **kwargs)
    priced = drafter.propose([int(prompt[-1])], TreeBudget(12, 4, 4, pricer=pricer), [4], GREEDY)[0]
    assert _same(plain, priced)
    assert pricer.forwards == 1 + len(runs), "one value call per head forward: the root pair's, then one per depth"


@pytest.mark.parametrize("stop", [1, 2, 3])
def test_a_row_stopped_at_a_depth_gets_the_tree_of_a_budget_that_deep(pair, stop):
    target, head = pair
    prompt = _prompt(seed=2)
    capped = _begun(target, head, prompt).propose([int(prompt[-1])], TreeBudget(12, stop, 4), [stop], GREEDY)[0]
    pricer = StopAt([stop])
    priced = _begun(target, head, prompt).propose([int(prompt[-1])], TreeBudget(12, 5, 4, pricer=pricer), [5], GREEDY)[0]
    assert _same(capped, priced)
    assert int(priced.depths.max()) <= stop
    assert pricer.forwards == stop, "no head forward past the depth it stopped at (the rerank may keep a shallower tree)"


def test_the_frontier_values_are_those_child_values_gave(pair):
    """At depth 2 the pricer is shown the root's best `width` children with the values it gave them
    (StopAt: their q), best first."""
    target, head = pair
    prompt = _prompt(seed=4)
    pricer = StopAt([99])
    _begun(target, head, prompt).propose([int(prompt[-1])], TreeBudget(60, 3, 3, pricer=pricer), [3], GREEDY)
    depth, values = pricer.asked[0]
    children = _begun(target, head, prompt).propose([int(prompt[-1])], TreeBudget(3, 1, 3), [1], GREEDY)[0]
    assert depth == 2 and values.shape == (1, 3)
    assert np.allclose(values[0], np.sort(np.exp(children.scores[1:].double().numpy()))[::-1], rtol=1e-5)


def test_rows_of_a_batch_stop_on_their_own(pair):
    target, head = pair
    prompts = [_prompt(12, seed=5), _prompt(7, seed=6), _prompt(15, seed=7)]
    roots = [int(p[-1]) for p in prompts]
    stops = [1, 3, 2]
    trees = _begun(target, head, *prompts).propose(roots, TreeBudget(10, 4, 3, pricer=StopAt(stops)), [4] * 3, GREEDY)
    for b, (prompt, stop) in enumerate(zip(prompts, stops)):
        alone = _begun(target, head, prompt).propose([roots[b]], TreeBudget(10, stop, 3), [stop], GREEDY)[0]
        assert _same(trees[b], alone), f"row {b}"


def test_sampled_trees_are_shaped_by_their_budget_alone(pair):
    target, head = pair
    prompt = _prompt(seed=8)
    sampling = SamplingConfig(1.0)
    budget = TreeBudget(6, 3, 2, sampled=True)
    plain = _begun(target, head, prompt).propose([int(prompt[-1])], budget, [3], sampling,
                                                 generator=torch.Generator().manual_seed(1))[0]
    pricer = StopAt([1])
    priced = _begun(target, head, prompt).propose([int(prompt[-1])], TreeBudget(6, 3, 2, sampled=True, pricer=pricer),
                                                  [3], sampling, generator=torch.Generator().manual_seed(1))[0]
    assert _same(plain, priced) and torch.equal(plain.proposals, priced.proposals)
    assert pricer.forwards == 0


@pytest.mark.parametrize("arch", ALL_ARCHITECTURES)
def test_decoding_with_drafting_stopped_at_random_depths_equals_greedy(arch):
    """Lossless: where drafting stops changes which candidates exist, never the output."""
    model = tiny_model(arch)
    target = TargetModel(model)
    draws = np.random.default_rng(0)
    stops = []

    def rule(depth, values):
        go = draws.random(values.shape[0]) < 0.6
        stops.append(not go.all())
        return go

    pricer = StopAt([], rule=rule)
    controller = StaticController(TreeBudget(8, 4, 3, pricer=pricer))
    prompt = _prompt(11, seed=3)
    out = SpecDecoder(target, drafter=EagleDrafter(random_eagle_head(target, 64), target), controller=controller).generate(
        prompt[None], max_new_tokens=24)  # both stop at the model's EOS
    assert torch.equal(out.sequences[0], hf_greedy(model, prompt.tolist(), 24)[0])
    assert any(stops), "drafting was stopped on some steps"
