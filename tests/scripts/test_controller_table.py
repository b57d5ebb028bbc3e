"""`scripts/controller_table.py` prints the README's table from bench reports."""

import importlib.util
import json
from pathlib import Path

import pytest

from moe_spec.core.stats import GenerationStats
from moe_spec.experiments.report import build_report
from moe_spec.experiments.runner import Run

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("controller_table", ROOT / "scripts" / "controller_table.py")
controller_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(controller_table)


def _report(ms: dict[str, list[float]]) -> dict:
    """A bench report of 10 tokens per prompt at these per-prompt times, prompt 0 of class a, 1 of b."""
    runs = [Run((p,), m, GenerationStats(new_tokens=10, total_ms=t), ((1,) * 10,)) for m, times in ms.items()
            for p, t in enumerate(times)]
    return build_report(runs, list(ms), ["a", "b"], [{}, {}], {}, static_best=True)


def test_the_table_holds_each_reports_ratios(tmp_path, capsys):
    greedy = _report({"ar": [200, 200], "eagle2": [250, 250], "static:2": [100, 160], "static:4": [150, 100],
                      "moe-aware": [120, 120]})
    sampled = _report({"ar": [200, 200], "eagle2@sampled": [400, 400], "chain:3@sampled": [100, 100],
                       "static:2@sampled": [160, 160], "moe-aware": [100, 200]})
    (tmp_path / "greedy_shipped.json").write_text(json.dumps(greedy))
    (tmp_path / "sampling_foreign.json").write_text(json.dumps({"reports": {"temperature=1": sampled}}))
    assert controller_table.main(["--results", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| speedup over ar | greedy, shipped | T = 1, held-out |"
    split = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    cells = {row[0]: row[1:] for row in split}
    # greedy: static-best in hindsight is static:4 (250 ms), static-tuned takes static:4 for prompt 0 (chosen
    # on prompt 1) and static:2 for prompt 1 (chosen on prompt 0): 310 ms, 400 / 310 over ar
    assert cells["static-best (in hindsight)"][0] == "1.60x (static:4)"
    assert cells["static-tuned (chosen on the other prompts)"][0].startswith(f"{400 / 310:.2f}x")
    assert cells["**moe-aware**"][0] == f"**{400 / 240:.2f}x**"
    assert cells["moe-aware / eagle2"][0] == f"{500 / 240:.2f}"
    assert cells["best chain (sampled)"][1] == "2.00x (chain:3)"
    assert cells["moe-aware, worst class"][1] == "1.00x (b)"


def test_no_reports_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit):
        controller_table.main(["--results", str(tmp_path)])


def test_the_spread_between_passes_is_the_median_move_of_a_speedup():
    # pass 1 runs everything 2x slower (the machine's drift: no move), except m2, which also gains 20% on ar
    ms = {"ar": (100, 200), "m1": (50, 100), "m2": (50, 100 / 1.2), "m3": (80, 160)}
    runs = [Run((p,), m, GenerationStats(new_tokens=10, total_ms=t[r]), ((1,) * 10,), r)
            for m, t in ms.items() for r in range(2) for p in range(2)]
    report = build_report(runs, list(ms), ["a", "a"], [{}, {}], {})
    assert report["methods"]["m2"]["tokens_per_s_by_pass"] == [200.0, 120.0]
    assert controller_table.pass_spread(report) == pytest.approx(0.0), "median of 0, 0.2, 0"
    for name, figures in report["methods"].items():  # a report written before the field: derived alike
        del figures["tokens_per_s_by_pass"]
    for prompt in report["per_prompt"]:
        for entry in prompt["methods"].values():
            entry["batch"] = [prompt["index"]]
    assert controller_table.pass_rates(report, "m2") == pytest.approx([200.0, 120.0])


def test_the_batch_table_reads_the_batch_reports_only(tmp_path, capsys):
    four = _report({"ar": [200, 200], "static:2": [100, 160], "moe-aware": [150, 150]})
    (tmp_path / "batch_4_foreign.json").write_text(json.dumps(four))
    (tmp_path / "greedy_shipped.json").write_text(json.dumps(four))
    assert controller_table.main(["--results", str(tmp_path), "--batch"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| speedup over ar | B = 4, held-out |"
    cells = {row[0]: row[1:] for row in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    assert cells["**moe-aware**"] == ["**1.33x**"]
    assert cells["moe-aware / static-best"] == [f"{(400 / 300) / (400 / 260):.2f}"]


def test_the_accept_table_sets_top_candidates_against_sampled_ones(tmp_path, capsys):
    report = _report({"ar": [200, 200], "static:4@top": [150, 150], "static:4@sampled": [120, 120],
                      "eagle2@top": [300, 300], "eagle2@sampled": [250, 250]})
    lengths = {"static:4@top": 1.5, "static:4@sampled": 2.25, "eagle2@top": 2.0, "eagle2@sampled": 3.0}
    for name, length in lengths.items():
        report["methods"][name]["mean_accept_len"] = length
    (tmp_path / "sampling_shipped.json").write_text(json.dumps({"reports": {"temperature=1": report}}))
    assert controller_table.main(["--results", str(tmp_path), "--accept"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| accepted length, top / sampled candidates | 4 nodes | 8 nodes | 60 nodes |"
    assert lines[2] == "| T = 1, shipped | 1.50 / 2.25 (+50%) | - | 2.00 / 3.00 (+50%) |"
    (tmp_path / "sampling_shipped.json").unlink()
    (tmp_path / "greedy_shipped.json").write_text(json.dumps(_report({"ar": [200, 200], "moe-aware": [150, 150]})))
    with pytest.raises(SystemExit):  # no report benched both candidate schemes
        controller_table.main(["--results", str(tmp_path), "--accept"])
