import pytest
import torch

from moe_spec.core.drafting import TreeBudget
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.target import TargetModel
from moe_spec.drafters.lookup import LookupDrafter
from moe_spec.measure.decoding import TraceRecorder, decode_prompts
from moe_spec.testing.tiny_models import tiny_model

PROMPTS = [torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]), torch.tensor([9, 10, 11, 9, 10, 11, 9, 10])]


@pytest.fixture(scope="module")
def target():
    return TargetModel(tiny_model("qwen3_moe", num_hidden_layers=3))


def test_traces_are_the_engines_decoding(target):
    traces = decode_prompts(target, LookupDrafter(), PROMPTS, max_new_tokens=12)
    assert [t.prompt_index for t in traces] == [0, 1]
    for prompt, trace in zip(PROMPTS, traces):
        reference = SpecDecoder(target, LookupDrafter()).generate(prompt[None], max_new_tokens=12, eos_token_id=[])
        new = reference.sequences[0, prompt.numel():]
        # the context is the prompt, then each step's root and accepted drafts: the first 11 new tokens
        assert torch.equal(trace.tokens[: prompt.numel()], prompt)
        assert torch.equal(trace.tokens[prompt.numel():], new[: trace.tokens.numel() - prompt.numel()])
        assert trace.tokens.numel() == prompt.numel() + sum(len(s.acceptances[0].path) for s in trace.steps)
        assert trace.experts.shape == (3, trace.tokens.numel(), 2)
        assert all(s.batch == 1 for s in trace.steps)


def test_trace_context_and_routing_follow_the_accepted_paths(target):
    [trace] = decode_prompts(target, LookupDrafter(), PROMPTS[:1], max_new_tokens=12)
    for step in trace.steps:
        context = trace.context(step)
        path = step.acceptances[0].path
        committed = trace.tokens[context.numel(): context.numel() + len(path)]
        assert torch.equal(committed, step.tree().tokens[path])
        routed = trace.experts[:, context.numel(): context.numel() + len(path)]
        assert torch.equal(routed, step.experts()[:, path])
        assert step.experts().shape[1] == len(step.tree())


def test_trace_labels_match_the_accepted_path(target):
    [trace] = decode_prompts(target, LookupDrafter(), PROMPTS[:1], max_new_tokens=12)
    assert any(s.tree().num_drafted for s in trace.steps), "the lookup drafter proposes on a repetitive prompt"
    for step in trace.steps:
        tree, on_path, conditional = step.tree(), step.on_path(), step.conditional_accepted()
        for node in range(1, len(tree)):
            ancestors = [node]
            while int(tree.parents[ancestors[-1]]) > 0:
                ancestors.append(int(tree.parents[ancestors[-1]]))
            assert bool(on_path[node]) == all(bool(conditional[a]) for a in ancestors)


def test_a_candidate_budget_caps_every_verified_tree(target):
    budget = TreeBudget(2, 2, 2)
    traces = decode_prompts(target, LookupDrafter(), PROMPTS, max_new_tokens=12, budget=budget)
    assert all(s.tree().num_drafted <= 2 for t in traces for s in t.steps)


def test_the_recorder_splits_a_batch_into_one_trace_per_row(target):
    recorder = TraceRecorder()
    pad = 0
    ids = torch.full((2, 11), pad)
    ids[0], ids[1, 3:] = PROMPTS[0], PROMPTS[1]
    mask = (torch.arange(11)[None] >= torch.tensor([[0], [3]])).long()
    SpecDecoder(target, None, observer=recorder).generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=[])
    traces = recorder.traces()
    assert [t.prompt_index for t in traces] == [0, 1]
    for prompt, trace in zip(PROMPTS, traces):
        assert trace.tokens.numel() == prompt.numel() + 5  # no drafter: one committed root per step, 5 steps
        assert trace.experts.shape[1] == trace.tokens.numel()
        solo = decode_prompts(target, None, [prompt], max_new_tokens=6)[0]
        assert torch.equal(trace.tokens, solo.tokens)
