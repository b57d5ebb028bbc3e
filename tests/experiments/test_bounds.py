"""The selection ceiling is the exact optimum over per-step choices; a sized draft is charged by
the subtree's size; the decomposition's parts multiply out to the total gap. (That no policy beats
the ceilings on a real trace, and the oracles' properties there: `test_simulate.py`.)"""

import itertools
import random

import pytest

from moe_spec.experiments.bounds import (
    ALL_ORACLES, CEILING, REALISED, SIZED_CEILING, SIZED_DRAFT, STATIC_SIZED, TRUE_ROUTING, decomposition,
    path_prefix_options, selection_ceiling, sized_draft_ms,
)
from moe_spec.experiments.trace_file import step_from_json
from moe_spec.measure.latency import DraftCost
from moe_spec.profile.cost_model import CostModel


def _rate(options, picks):
    return sum(o[i][0] for o, i in zip(options, picks)) / sum(o[i][1] for o, i in zip(options, picks))


def test_dinkelbach_finds_the_brute_force_optimum_of_the_ratio_of_sums():
    rng = random.Random(0)
    for _ in range(200):
        options = []
        for _ in range(rng.randint(1, 4)):
            ms = 5.0 + rng.uniform(0, 5)
            steps = [(1, ms, (0,))]
            for k in range(1, rng.randint(1, 5)):
                ms += rng.uniform(0.1, 8.0)  # each further path node costs more verify time
                steps.append((k + 1, ms, tuple(range(k + 1))))
            options.append(steps)
        best = max(_rate(options, picks) for picks in itertools.product(*[range(len(o)) for o in options]))
        assert abs(_rate(options, selection_ceiling(options)) - best) < 1e-12


def test_cheap_path_nodes_are_all_taken_and_dear_ones_dropped():
    cheap = [[(1, 10.0, (0,)), (2, 10.5, (0, 1)), (3, 11.0, (0, 1, 2))]]
    dear = [[(1, 10.0, (0,)), (2, 30.0, (0, 1))]]
    assert selection_ceiling(cheap) == [2]
    assert selection_ceiling(dear) == [0]


# a 7-node step: root -> 1 -> 3 -> 5 (the accepted path), root -> 2 -> 4, 3 -> 6; one MoE layer, top-2 of 8
STEP = {"kind": "step", "prompt": 0, "class": "copy", "step": 0, "prefix_len": 9,
        "tokens": [5, 6, 7, 8, 9, 10, 11], "parents": [-1, 0, 0, 1, 2, 3, 3],
        "scores": [0.0, -0.1, -0.5, -0.3, -0.9, -0.6, -1.2], "candidate_nodes": 7,
        "argmax": [6, 8, 1, 10, 1, 1, 1], "experts": [[[0, 1], [0, 2], [3, 4], [2, 5], [6, 7], [1, 5], [6, 0]]],
        "accepted_path": [0, 1, 3, 5], "bonus_token": 1, "verify_ms": 20.0, "draft_ms": 6.0, "plan_ms": 0.1}


def _step():
    return step_from_json(STEP, layers=(0,), num_experts=8)


def test_a_sized_draft_is_free_without_drafts_grows_with_depth_and_is_the_recorded_time_for_the_whole_tree():
    step = _step()
    assert sized_draft_ms(step, [0], 6.0, None) == 0.0
    by_depth = [sized_draft_ms(step, keep, 6.0, None) for keep in ([0, 1], [0, 1, 3], [0, 1, 3, 5])]
    assert by_depth == pytest.approx([2.0, 4.0, 6.0])  # depth / the candidates' depth 3, without a formula
    assert sized_draft_ms(step, range(7), 6.0, None) == pytest.approx(6.0)


def test_a_sized_draft_follows_the_drafters_measured_formula_and_never_goes_negative():
    step = _step()
    formula = DraftCost(base_ms=-1.0, per_depth_ms=2.0, per_node_ms=0.5, samples=())  # full tree: -1 + 6 + 3 = 8 ms
    assert sized_draft_ms(step, [0, 1], 6.0, formula) == pytest.approx(6.0 * (-1 + 2 + 0.5) / 8)
    assert sized_draft_ms(step, [0, 1, 2], 6.0, formula) == pytest.approx(6.0 * (-1 + 2 + 1.0) / 8)  # wider, same depth
    assert sized_draft_ms(step, range(7), 6.0, formula) == pytest.approx(6.0)
    steep = DraftCost(base_ms=-5.0, per_depth_ms=2.0, per_node_ms=0.5, samples=())
    assert sized_draft_ms(step, [0, 1], 6.0, steep) == 0.0  # -2.5 ms predicted: clamped


def test_the_sized_ceiling_is_the_best_path_prefix_with_each_prefix_charged_its_own_draft():
    step = _step()
    cost = CostModel(base_ms=4.0, per_token_ms=1.0, per_expert_ms=(0.5,), num_layers=1, source="test")

    def unique(s, keep):
        return (len(set(s.experts()[0, list(keep)].flatten().tolist())),)

    options = path_prefix_options(step, lambda keep: sized_draft_ms(step, keep, 6.0, None)
                                  + cost.predict_ms(len(keep), unique(step, keep)))
    # prefix k: k+1 tokens; verify 4 + (k+1) + 0.5 * |experts of the prefix|; draft 2 ms per level drafted
    assert [o[1] for o in options] == pytest.approx([4 + 1 + 1.0, 2 + 4 + 2 + 1.5, 4 + 4 + 3 + 2.0, 6 + 4 + 4 + 2.0])  # experts {0,1} {0,1,2} {0,1,2,5} x2
    assert selection_ceiling([options]) == [3]  # 4 tokens / 16 ms beats 1 / 6, 2 / 9.5 and 3 / 13


def test_the_decomposition_multiplies_out_to_the_total_gap():
    figures = {"moe-aware": {"tokens_per_s": 10.0, "mean_accept_len": 2.0, "predicted_accept_len": 2.5},
               SIZED_DRAFT: {"tokens_per_s": 12.0}, TRUE_ROUTING: {"tokens_per_s": 9.0},
               REALISED: {"tokens_per_s": 15.0}, ALL_ORACLES: {"tokens_per_s": 20.0},
               SIZED_CEILING: {"tokens_per_s": 25.0}, CEILING: {"tokens_per_s": 22.0},
               "static-best": {"tokens_per_s": 8.0, "budget": "static:4"}, STATIC_SIZED: {"tokens_per_s": 11.0}}
    parts = decomposition(figures)
    moe = parts["moe-aware"]
    assert (moe["drafting"], moe["routing"], moe["calibration"]) == (1.2, 0.9, 1.5)
    assert moe["all_oracles"] == 2.0 and moe["remaining_selection"] == 1.25 and moe["to_ceiling"] == 2.2
    together = moe["drafting"] * moe["routing"] * moe["calibration"] * moe["interaction"]
    assert together == pytest.approx(moe["all_oracles"], rel=1e-3)
    assert together * moe["remaining_selection"] == pytest.approx(moe["total_to_sized_ceiling"], rel=1e-3)
    assert parts["static-best"]["drafting"] * parts["static-best"]["remaining_selection"] == pytest.approx(25.0 / 8.0, rel=1e-3)
    assert "moe-aware" not in decomposition({k: v for k, v in figures.items() if k != ALL_ORACLES})
