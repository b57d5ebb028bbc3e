"""A greedy step of N nodes tells exactly what every smaller fixed budget would have made: checked
against decoding each smaller budget from the same prefix, with the lookup drafter and an EAGLE head."""

import pytest
import torch

from moe_spec import LookupDrafter, SpecDecoder
from moe_spec.core.drafting import EAGLE2_BUDGET
from moe_spec.core.step_record import DecodeObserver
from moe_spec.core.target import TargetModel
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.policy.fewer_nodes import tokens_with_fewer_nodes
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


def test_a_sampled_step_tells_nothing():
    model = tiny_model("qwen3_moe")
    _, records = _decode(TargetModel(model), LookupDrafter(), 4, _echo_prompt(model), 6, temperature=1.0)
    assert records and all(tokens_with_fewer_nodes(record, 2) is None for record in records)
