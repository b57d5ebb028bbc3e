"""A step of N nodes tells what every smaller fixed budget would have made: exactly when greedy, its
expectation given the drafts when sampling; checked against decoding each smaller budget from the
same prefix (the lookup drafter and an EAGLE head) and against the acceptance draws themselves."""

import pytest
import torch

from moe_spec import LookupDrafter, SpecDecoder
from moe_spec.core.acceptance import accept_sampled
from moe_spec.core.drafting import EAGLE2_BUDGET, TreeBudget
from moe_spec.core.step_record import DecodeObserver
from moe_spec.core.target import TargetModel
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.policy.fewer_nodes import tokens_with_fewer_nodes
from moe_spec.policy.candidate_scheme import CandidateScheme
from moe_spec.policy.static import StaticController
from moe_spec.testing.helpers import PLAIN_PROMPT, hf_greedy, random_eagle_head
from moe_spec.testing.tiny_models import tiny_model


class Steps(DecodeObserver):
    def __init__(self):
        self.records = []

    def on_step(self, record):
        self.records.append(record)


def _decode(target, drafter, nodes: int, prompt: list[int], new: int, temperature: float = 0.0):
    steps = Steps()
    decoder = SpecDecoder(target, drafter=drafter, controller=StaticController(EAGLE2_BUDGET.with_nodes(nodes)),
                          observer=steps)
    out = decoder.generate(torch.tensor([prompt]), max_new_tokens=new, temperature=temperature,
                           generator=torch.Generator().manual_seed(0))
    return out.sequences[0].tolist(), steps.records


def _echo_prompt(model) -> list[int]:
    """A prompt whose lookup drafts the target's own continuation (so trees are accepted deep)."""
    continuation = hf_greedy(model, PLAIN_PROMPT, 24)[0, len(PLAIN_PROMPT):].tolist()
    return PLAIN_PROMPT + continuation + PLAIN_PROMPT


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_a_steps_tokens_with_fewer_nodes_are_what_the_smaller_budget_makes_from_the_same_prefix(arch):
    model = tiny_model(arch)
    target = TargetModel(model)
    prompt = _echo_prompt(model)
    new = 16
    sequence, records = _decode(target, LookupDrafter(), 6, prompt, new)
    told = fewer = 0
    position = len(prompt)
    for record in records:
        for nodes in (1, 2, 4):
            credited = tokens_with_fewer_nodes(record, nodes)
            # the same tokens left to make: a drafter's candidates depend on how deep it may draft
            _, own = _decode(target, LookupDrafter(), nodes, sequence[:position], new - (position - len(prompt)))
            assert credited == own[0].tokens_produced, (position, nodes)
            told += 1
            fewer += credited < record.tokens_produced
        position += record.tokens_produced
    assert told >= 6 and fewer >= 1, "the steps must include some a smaller budget makes less of"


def test_an_eagle_heads_smaller_budget_drafts_the_best_of_a_larger_ones_nodes():
    model = tiny_model("qwen3_moe")
    target = TargetModel(model)
    head = random_eagle_head(target)
    _, large = _decode(target, EagleDrafter(head, target), 6, PLAIN_PROMPT, 8)
    for nodes in (1, 2, 4):
        _, small = _decode(target, EagleDrafter(head, target), nodes, PLAIN_PROMPT, 8)
        tree, kept = large[0].candidates[0], small[0].candidates[0]
        scores = tree.scores.tolist()
        best = sorted(range(1, len(tree)), key=lambda i: (-scores[i], i))[:nodes]
        expected = tree.subtree([0] + best)
        assert torch.equal(kept.tokens, expected.tokens) and torch.equal(kept.parents, expected.parents)
        assert tokens_with_fewer_nodes(large[0], nodes) == small[0].tokens_produced


def _static(nodes: int, chain: bool = False) -> StaticController:
    budget = TreeBudget(nodes, nodes, 1) if chain else EAGLE2_BUDGET.with_nodes(nodes)
    return StaticController(budget, CandidateScheme.SAMPLED if chain else CandidateScheme.TOP)


def _sampled_records(target, drafter, controller, prompt: list[int], new: int, seed: int = 0):
    steps = Steps()
    out = SpecDecoder(target, drafter=drafter, controller=controller, observer=steps).generate(
        torch.tensor([prompt]), max_new_tokens=new, temperature=1.0, generator=torch.Generator().manual_seed(seed))
    return out.sequences[0].tolist(), steps.records


def test_a_sampled_chain_of_n_draws_first_what_a_shorter_chain_draws():
    target = TargetModel(tiny_model("qwen3_moe"))
    head = random_eagle_head(target)
    # the first steps: the same prompt and generator, so the same state (enough new tokens that the
    # chain is not cut short by the end of the request)
    _, (long_step, *_) = _sampled_records(target, EagleDrafter(head, target), _static(4, chain=True), PLAIN_PROMPT, 8)
    assert long_step.verified.num_drafted == 4
    for nodes in (1, 2, 3):
        _, (short_step, *_) = _sampled_records(target, EagleDrafter(head, target), _static(nodes, chain=True),
                                               PLAIN_PROMPT, 8)
        assert torch.equal(short_step.candidates[0].tokens, long_step.candidates[0].tokens[: nodes + 1])
        assert tokens_with_fewer_nodes(long_step, nodes) == pytest.approx(tokens_with_fewer_nodes(short_step))
    assert tokens_with_fewer_nodes(long_step, 5) is None, "a longer chain would have drawn more"


@pytest.mark.parametrize("chain", [False, True])
def test_the_expected_tokens_are_the_mean_of_the_acceptance_draws(chain):
    """Recursive rejection run again and again on one verified step (sibling trees of top
    candidates; a sampled chain and its prefixes): the mean tokens are the expectation told."""
    target = TargetModel(tiny_model("qwen3_moe"))
    controller = _static(4, chain=True) if chain else _static(6)
    _, records = _sampled_records(target, EagleDrafter(random_eagle_head(target), target), controller, PLAIN_PROMPT, 8)
    record = records[0]
    tree, logits = record.verified[0], record.logits[0, : len(record.verified[0])]
    assert tree.num_drafted >= 4 and (chain or tree.max_depth < tree.num_drafted)
    generator = torch.Generator().manual_seed(1)
    for nodes in (1, 2, 3, None):
        kept = tree if nodes is None else tree.subtree(
            list(range(nodes + 1)) if chain else
            [0] + sorted(range(1, len(tree)), key=lambda i: (-tree.score_list[i], i))[:nodes])
        sub_logits = logits[_kept_indices(tree, kept)]
        draws = torch.tensor([float(accept_sampled(kept, sub_logits, record.sampling, generator).num_accepted + 1)
                              for _ in range(3000)])
        expected = tokens_with_fewer_nodes(record, nodes)
        assert expected is not None
        assert abs(draws.mean() - expected) < 4 * draws.std() / 3000 ** 0.5 + 1e-9, (nodes, float(draws.mean()), expected)


def _kept_indices(tree, kept) -> list[int]:
    """The rows of `tree` that `kept` (a subtree of it, in its order) holds: matched by root path."""
    paths = {}
    for node, parent in enumerate(tree.parent_list):
        paths[node] = (paths[parent] if parent >= 0 else ()) + (int(tree.tokens[node]),)
    index = {path: node for node, path in paths.items()}
    sub_paths = {}
    rows = []
    for node, parent in enumerate(kept.parent_list):
        sub_paths[node] = (sub_paths[parent] if parent >= 0 else ()) + (int(kept.tokens[node]),)
        rows.append(index[sub_paths[node]])
    return rows
