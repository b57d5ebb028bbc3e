"""`static-tuned`: each batch decoded by the fixed budget best on the other batches (`report.static_tuned_runs`)."""

from __future__ import annotations

import itertools
import json

import pytest

from moe_spec.cli.main import main
from moe_spec.core.stats import GenerationStats
from moe_spec.experiments.report import STATIC_TUNED, build_report, static_tuned_runs
from moe_spec.experiments.runner import Run, prompt_generator
from moe_spec.testing.tiny_models import tiny_model


def _run(prompt: int, method: str, tokens: int, ms: float, repeat: int = 0) -> Run:
    return Run((prompt,), method, GenerationStats(new_tokens=tokens, total_ms=ms), ((1,) * tokens,), repeat)


def test_each_batch_gets_the_budget_best_on_the_others_never_its_own_luck():
    # per prompt, ms for 10 tokens: static:2 is steadily good, static:8 wins prompt 2 by luck alone
    ms = {"static:2": [100, 100, 100, 100], "static:8": [130, 130, 60, 130], "ar": [150, 150, 150, 150]}
    runs = [_run(p, m, 10, times[p], repeat) for repeat in range(2) for m, times in ms.items() for p in range(4)]
    tuned, chosen = static_tuned_runs(runs)
    assert chosen == {"static:2": 4}, "prompt 2's luck chooses nothing for prompt 2"
    assert {(r.prompt_index, r.repeat) for r in tuned} == set(itertools.product(range(4), range(2)))
    assert all(r.method == STATIC_TUNED and r.stats.total_ms == 100 for r in tuned)
    report = build_report(runs, list(ms), ["a", "a", "b", "b"], [{}] * 4, {}, static_best=True)
    assert report["methods"]["static-best"]["budget"] == "static:2"
    assert report["per_class"]["b"]["static-best"]["budget"] == "static:8", "in hindsight: the lucky pick"
    assert report["per_class"]["b"]["static-tuned"]["tokens_per_s"] == pytest.approx(100.0)
    assert report["methods"][STATIC_TUNED]["speedup_vs_ar"] == pytest.approx(1.5)
    assert report["methods"][STATIC_TUNED]["budgets"] == {"static:2": 4}


def test_a_choice_is_computed_from_the_other_batches_totals():
    # static:8 is best on prompts 1-3 together, static:2 on prompts 0, 2, 3: each held-out prompt gets the other's pick
    ms = {"static:2": [50, 200, 100, 100], "static:8": [200, 60, 95, 95]}
    runs = [_run(p, m, 10, times[p]) for m, times in ms.items() for p in range(4)]
    tuned, chosen = static_tuned_runs(runs)
    for prompt in range(4):
        others = [p for p in range(4) if p != prompt]
        best = min(ms, key=lambda m: sum(ms[m][p] for p in others))
        assert [r.stats.total_ms for r in tuned if r.prompt_index == prompt] == [ms[best][prompt]]
    assert sum(chosen.values()) == 4


def test_without_two_batches_or_a_fixed_budget_there_is_nothing_to_tune_on():
    assert static_tuned_runs([_run(0, "static:2", 10, 100.0), _run(0, "static:4", 10, 90.0)]) == ([], {})
    assert static_tuned_runs([_run(0, "ar", 10, 100.0), _run(1, "ar", 10, 90.0)]) == ([], {})


def test_repeated_passes_draw_afresh_and_the_first_pass_keeps_its_draws():
    draws = {repeat: torch_draws(prompt_generator(0, 3, repeat)) for repeat in range(3)}
    assert draws[0] == torch_draws(prompt_generator(0, 3)), "pass 0 is the single-pass bench's"
    assert len(set(draws.values())) == 3


def torch_draws(generator) -> tuple[float, ...]:
    import torch

    return tuple(torch.rand(4, generator=generator).tolist())


def test_the_bench_reports_the_tuned_budget_beside_static_best(tmp_path):
    tiny_model("qwen3_moe").save_pretrained(tmp_path / "model")
    prompts = tmp_path / "p.jsonl"
    rows = [("a", [5, 6, 7, 5, 6, 7, 5]), ("a", [9, 8, 7]), ("b", [11, 12, 13, 11, 12])]
    prompts.write_text("".join(json.dumps({"class": c, "prompt_ids": p}) + "\n" for c, p in rows))
    out = tmp_path / "out.json"
    assert main(["bench", "--model", str(tmp_path / "model"), "--drafter", "lookup", "--prompts", str(prompts),
                 "--methods", "ar,static-best", "--max-new-tokens", "12", "--warmup-tokens", "0",
                 "--temperature", "1.0", "--repeats", "2", "--no-progress", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    tuned = report["methods"][STATIC_TUNED]
    grid = {name for name in report["methods"] if name.startswith("static:")}
    assert sum(tuned["budgets"].values()) == 3 and set(tuned["budgets"]) <= grid
    assert tuned["repeats"] == 2 and tuned["prompts"] == 3
    assert set(report["per_class"]["b"]) >= {STATIC_TUNED, "static-best"}
