"""The profile's loop stage: passes of every size, timed by the engine, on a real tiny pair; the
output stays the target's greedy output, and the profile carries the aligned model."""

import pytest
import torch

from moe_spec import SpecDecoder
from moe_spec.core.target import TargetModel
from moe_spec.core.step_record import DecodeObserver
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.measure.latency import TimingConfig
from moe_spec.measure.loop_passes import SizeCycle, loop_passes
from moe_spec.measure.profiler import ProfileSettings, build_profile
from moe_spec.profile.cost_model import CostModel
from moe_spec.profile.loop_alignment import LoopMap
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT, hf_greedy, random_eagle_head
from moe_spec.testing.tiny_models import tiny_model


@pytest.fixture(scope="module")
def pair():
    model = tiny_model("qwen3_moe")
    target = TargetModel(model)
    return model, target, EagleDrafter(random_eagle_head(target, 64), target)


class _Sizes(DecodeObserver):
    def __init__(self):
        self.sizes = []

    def on_step(self, record):
        self.sizes.append((record.verified.num_drafted, record.candidates[0].num_drafted))


def test_the_cycle_verifies_each_size_in_turn_and_stays_lossless(pair):
    model, target, drafter = pair
    sizes = (0, 1, 3, 8)
    observer = _Sizes()
    result = SpecDecoder(target, drafter, SizeCycle(drafter.default_budget, sizes), observer=observer).generate(
        torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=20, eos_token_id=[])
    assert torch.equal(result.sequences, hf_greedy(model, REPETITIVE_PROMPT, 20))
    for step, (verified, drafted) in enumerate(observer.sizes):
        assert verified == min(sizes[step % len(sizes)], drafted)


def test_loop_passes_record_the_engines_timing_per_prompt_split(pair):
    _, target, drafter = pair
    prompts = [torch.tensor(p) for p in (REPETITIVE_PROMPT, PLAIN_PROMPT, REPETITIVE_PROMPT[2:])]
    passes = loop_passes(target, drafter, prompts, frozenset({1}), max_new_tokens=8)
    assert passes.fit and passes.heldout
    assert all(p.ms > 0 and p.rows == 1 and len(p.unique_experts) == len(target.routers) for p in passes.fit)
    assert {p.num_tokens for p in passes.fit} >= {1, 2, 3}  # plain steps and small trees among them
    assert all(min(p.unique_experts) >= target.top_k for p in passes.fit + passes.heldout)


def test_the_profile_prices_with_the_sweep_model_mapped_onto_the_loop(pair):
    _, target, drafter = pair
    prompts = [torch.tensor(p) for p in (REPETITIVE_PROMPT, PLAIN_PROMPT, REPETITIVE_PROMPT[3:] * 2, PLAIN_PROMPT[::-1])]
    settings = ProfileSettings(max_new_tokens=12, prefix_len=16, grid_tokens=(1, 4, 16), grid_experts=(2, 4, 8),
                               natural_trees=4, curve_sizes=(1, 2, 4), batch_sizes=(),
                               timing=TimingConfig(repeats=1, warmup=0, evict_mb=0))
    profile = build_profile(target, drafter, prompts, settings)
    report = profile.details["cost_model_report"]["loop_alignment"]
    sweep = CostModel.from_dict(report["sweep_model"])
    mapping = LoopMap(report["offset_ms"], report["factor"], report["passes"], report["dropped"])
    assert profile.cost_model == mapping.apply(sweep)
    assert report["heldout_loop_passes"] > 0 and report["heldout_loop_error"]["n"] == report["heldout_loop_passes"]
    unaligned = build_profile(target, drafter, prompts, ProfileSettings(**{**settings.__dict__, "loop_alignment": False}))
    assert "loop_alignment" not in unaligned.details["cost_model_report"]
