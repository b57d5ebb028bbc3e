"""The sweep's cost model mapped onto passes timed in the decode loop: the map a line through
them recovers, outliers left out, the fixed part never negative, one size or few passes a factor only."""

import pytest

from moe_spec.profile.cost_model import CostModel, CostSample, predict_sample
from moe_spec.profile.loop_alignment import LoopMap, fit_loop_map

SWEEP = CostModel(base_ms=10.0, per_token_ms=0.1, per_expert_ms=(0.03,), num_layers=2)


def _passes(offset: float, factor: float, sizes=(1, 2, 4, 8, 16, 32, 60), repeats: int = 3) -> list[CostSample]:
    passes = []
    for size in sizes * repeats:
        unique = (min(4 * size, 64), min(3 * size + 1, 64))
        sample = CostSample(size, unique, 0.0)
        passes.append(CostSample(size, unique, offset + factor * predict_sample(SWEEP, sample)))
    return passes


def test_the_map_is_the_line_through_the_loop_passes_and_applies_to_every_term():
    mapping = fit_loop_map(SWEEP, _passes(-2.0, 1.2))
    assert mapping.offset_ms == pytest.approx(-2.0) and mapping.factor == pytest.approx(1.2)
    assert (mapping.passes, mapping.dropped) == (21, 0)
    aligned = mapping.apply(SWEEP)
    assert aligned.base_ms == pytest.approx(10.0 * 1.2 - 2.0)
    assert aligned.per_token_ms == pytest.approx(0.12) and aligned.per_expert_ms == pytest.approx((0.036,))
    for sample in _passes(-2.0, 1.2, repeats=1):
        assert predict_sample(aligned, sample) == pytest.approx(sample.ms)


def test_a_pass_the_os_interrupted_is_left_out_of_the_refit():
    passes = _passes(-2.0, 1.2)
    passes[3] = CostSample(passes[3].num_tokens, passes[3].unique_experts, passes[3].ms * 3)
    mapping = fit_loop_map(SWEEP, passes)
    assert mapping.dropped == 1
    assert mapping.offset_ms == pytest.approx(-2.0) and mapping.factor == pytest.approx(1.2)


def test_the_aligned_fixed_part_is_never_negative():
    sweep = CostModel(base_ms=1.0, per_token_ms=1.0, per_expert_ms=(0.03,), num_layers=2)
    passes = [CostSample(s.num_tokens, s.unique_experts, -3.0 + 2.0 * predict_sample(sweep, s)) for s in _passes(0.0, 1.0)]
    assert min(p.ms for p in passes) > 0  # every pass positive, yet the line's fixed part is 2 - 3 < 0
    mapping = fit_loop_map(sweep, passes)
    assert mapping.apply(sweep).base_ms == pytest.approx(0.0, abs=1e-9)
    assert mapping.factor > 0


@pytest.mark.parametrize("passes", [_passes(-2.0, 1.2, sizes=(4,), repeats=10), _passes(-2.0, 1.2, repeats=1)[:5]])
def test_passes_of_one_size_or_too_few_fit_a_factor_only(passes):
    mapping = fit_loop_map(SWEEP, passes)
    assert mapping.offset_ms == 0.0 and mapping.factor > 0
    if len({p.num_tokens for p in passes}) == 1:
        assert predict_sample(mapping.apply(SWEEP), passes[0]) == pytest.approx(passes[0].ms)


def test_no_passes_or_non_positive_times_are_refused():
    with pytest.raises(ValueError, match="no loop passes"):
        fit_loop_map(SWEEP, [])
    with pytest.raises(ValueError, match="must be positive"):
        fit_loop_map(SWEEP, [CostSample(1, (4, 4), 0.0)])


def test_the_fetch_cost_and_row_term_follow_the_map():
    batched = CostModel(10.0, 0.1, (0.03,), 2, per_row_ms=0.5)
    aligned = LoopMap(1.0, 2.0, 10, 0).apply(batched)
    assert (aligned.base_ms, aligned.per_row_ms, aligned.per_token_ms) == (21.0, 1.0, 0.2)
