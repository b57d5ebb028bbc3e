"""The decoding step itself: what `SpecDecoder` drafts, plans, verifies, records and hands on."""

import pytest
import torch

from moe_spec import LookupDrafter, SpecDecoder, TreeBudget
from moe_spec.core.control import StepPlan
from moe_spec.core.drafting import NO_DRAFT
from moe_spec.core.forest import StepForest
from moe_spec.core.step_record import DecodeObserver
from moe_spec.core.tree import DraftTree
from moe_spec.errors import MoeSpecError
from moe_spec.policy.static import StaticController
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT, hf_greedy
from moe_spec.testing.tiny_models import tiny_model


class Recorder(DecodeObserver):
    def __init__(self):
        self.prefills, self.steps = [], []

    def on_prefill(self, record):
        self.prefills.append(record)

    def on_step(self, record):
        self.steps.append(record)


class ScriptedController:
    """Verifies the root alone at every `plain_every`-th step and the first `nodes` best nodes
    otherwise; records every call so the protocol's order can be checked."""

    def __init__(self, nodes: int, plain_every: int = 0, budget: TreeBudget = TreeBudget(8, 4, 2)):
        self.nodes, self.plain_every, self.budget = nodes, plain_every, budget
        self.calls: list[str] = []
        self.plans: list[StepForest] = []

    def begin(self, default, sampling):
        self.calls.append("begin")
        return self.budget

    def plan(self, candidates, draft_ms):
        self.calls.append("plan")
        step = self.calls.count("plan")
        plain = self.plain_every and step % self.plain_every == 0
        chosen = StepForest(tuple(DraftTree.root_only(int(t.tokens[0])) if plain else StaticController(
            TreeBudget(self.nodes, 4, 2))._select_one(t) for t in candidates))
        self.plans.append(chosen)
        return StepPlan(chosen, NO_DRAFT if plain else self.budget)

    def observe(self, record):
        self.calls.append("observe")


def test_each_step_is_one_plan_and_one_observe_of_what_was_verified():
    model = tiny_model("qwen3_moe")
    controller, recorder = ScriptedController(nodes=3), Recorder()
    decoder = SpecDecoder(model, drafter=LookupDrafter(), controller=controller, observer=recorder)
    result = decoder.generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=20)
    assert torch.equal(result.sequences, hf_greedy(model, REPETITIVE_PROMPT, 20))
    steps = len(result.stats.steps)
    assert controller.calls == ["begin"] + ["plan", "observe"] * steps
    assert len(recorder.steps) == steps
    for planned, record, stats in zip(controller.plans, recorder.steps, result.stats.steps):
        assert record.verified is planned, "the record holds the plan's trees"
        assert record.tokens_produced == stats.accepted_length
        assert record.verified.num_drafted == stats.tree_size <= 3
        assert record.verified.pass_tokens == stats.verified_tokens


def test_a_plan_that_skips_drafting_makes_the_next_step_plain():
    model = tiny_model("olmoe")
    controller, recorder = ScriptedController(nodes=4, plain_every=2), Recorder()
    decoder = SpecDecoder(model, drafter=LookupDrafter(), controller=controller, observer=recorder)
    result = decoder.generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=24)
    assert torch.equal(result.sequences, hf_greedy(model, REPETITIVE_PROMPT, 24))
    for previous, record in zip(controller.plans[1::2], recorder.steps[2::2]):
        assert all(len(t) == 1 for t in previous)  # a plain choice, whose plan budgeted no draft ...
        assert all(len(t) == 1 for t in record.candidates), "... so the next step drafts nothing"


def test_records_follow_the_cache_prefix_and_the_routing_of_each_node():
    model = tiny_model("mixtral")
    recorder = Recorder()
    decoder = SpecDecoder(model, drafter=LookupDrafter(), observer=recorder)
    result = decoder.generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=16)
    (prefill,) = recorder.prefills
    assert prefill.prompts[0].tolist() == REPETITIVE_PROMPT
    assert prefill.experts(0).shape == (model.config.num_hidden_layers, len(REPETITIVE_PROMPT), 2)
    position = len(REPETITIVE_PROMPT)
    for record in recorder.steps:
        assert record.prefix_lens == (position,), "each step starts where the committed tokens end"
        tree = record.tree(0)
        assert record.experts(0).shape == (model.config.num_hidden_layers, len(tree), 2)
        assert record.on_path(0)[record.acceptances[0].path].all()
        position += record.tokens_produced
    assert position == len(REPETITIVE_PROMPT) + result.stats.new_tokens - 1, "the last token is produced, not cached"


def test_finished_rows_leave_the_batch_and_their_records():
    model = tiny_model("qwen2_moe")
    rows = [REPETITIVE_PROMPT, PLAIN_PROMPT]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = (torch.arange(width)[None] >= torch.tensor([[width - len(r)] for r in rows])).long()
    recorder = Recorder()
    eos = hf_greedy(model, PLAIN_PROMPT, 6)[0, len(PLAIN_PROMPT) + 2].item()  # the plain row's third new token
    decoder = SpecDecoder(model, drafter=LookupDrafter(), observer=recorder)
    result = decoder.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos)
    assert recorder.steps[0].rows == (0, 1)
    assert result.stats.new_tokens_per_row == [12, 3]  # the plain row stops at its EOS
    # a step makes at most 1 + 8 (the lookup drafter's depth) tokens, so row 0 decodes on alone
    assert recorder.steps[-1].rows == (0,)
    for record in recorder.steps:
        for b in range(record.batch):
            one = record.row(b)
            assert one.rows == (record.rows[b],) and one.tree(0) == record.tree(b)
            assert torch.equal(one.experts(0), record.experts(b))


def test_a_plan_for_the_wrong_rows_is_refused_and_the_decoder_stays_usable():
    model = tiny_model("qwen3_moe")

    class Broken(ScriptedController):
        def plan(self, candidates, draft_ms):
            return StepPlan(StepForest(tuple(candidates) * 2), self.budget)

    decoder = SpecDecoder(model, drafter=LookupDrafter(), controller=Broken(nodes=2))
    with pytest.raises(MoeSpecError, match="planned 2 rows for a batch of 1"):
        decoder.generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=8)
    decoder.controller = ScriptedController(nodes=2)
    result = decoder.generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=8)
    assert torch.equal(result.sequences, hf_greedy(model, REPETITIVE_PROMPT, 8))


def test_plan_time_is_reported_apart_from_draft_time():
    model = tiny_model("qwen3_moe")
    result = SpecDecoder(model, drafter=LookupDrafter(), controller=ScriptedController(nodes=3)).generate(
        torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=12)
    assert all(step.plan_ms > 0 and step.draft_ms >= 0 for step in result.stats.steps)
    assert result.stats.summary()["plan_ms"] == pytest.approx(sum(s.plan_ms for s in result.stats.steps), abs=1e-2)
