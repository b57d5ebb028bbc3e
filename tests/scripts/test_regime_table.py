"""`scripts/regime_table.py` prints the per-regime table from bench reports."""

import importlib.util
import json
from pathlib import Path

from moe_spec.core.stats import GenerationStats
from moe_spec.experiments.report import build_report
from moe_spec.experiments.runner import Run

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("regime_table", ROOT / "scripts" / "regime_table.py")
regime_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(regime_table)


def _report(ms: dict[str, list[list[float]]]) -> dict:
    """Two passes over two prompts (class a, then b) of 10 tokens each at these per-pass, per-prompt times."""
    runs = [Run((p,), m, GenerationStats(new_tokens=10, total_ms=t), ((1,) * 10,), repeat)
            for m, passes in ms.items() for repeat, times in enumerate(passes) for p, t in enumerate(times)]
    return build_report(runs, list(ms), ["a", "b"], [{}, {}], {}, static_best=True)


def test_each_row_holds_its_reports_ratios_and_noise(tmp_path):
    report = _report({"ar": [[200, 200], [200, 200]], "static:2": [[100, 160], [100, 160]],
                      "static:4": [[150, 100], [150, 100]], "moe-aware": [[125, 125], [100, 100]],
                      "moe-aware-unbounded": [[110, 110], [110, 110]]})
    report["decisions"] = {"moe-aware": {"sized": 0.6, "static:2": 0.4}}
    (tmp_path / "greedy_shipped.json").write_text(json.dumps(report))
    lines = regime_table.table(tmp_path).splitlines()
    assert len(lines) == 3 and lines[2].startswith("| greedy, B = 1 | shipped |")
    cells = [cell.strip() for cell in lines[2].strip("|").split("|")]
    assert cells[2] == "**1.78x**"  # 800 ms of ar against 450 ms
    assert cells[5].endswith("(static:2)") or cells[5].endswith("(static:4)")
    assert cells[10] == "sized 60%, static:2 40%"
    assert cells[11].startswith("2; ")  # two passes, the median move between them
    assert regime_table.table(tmp_path / "none").count("\n") == 1, "no report: the header alone"


def test_a_report_of_one_batch_is_tuned_on_the_other_sets_best_budget(tmp_path):
    def one_batch(static2: float, static4: float) -> dict:  # one class, so no other batch to tune on
        runs = [Run((0,), m, GenerationStats(new_tokens=10, total_ms=t), ((1,) * 10,), 0)
                for m, t in (("ar", 200), ("static:2", static2), ("static:4", static4), ("moe-aware", 100))]
        return build_report(runs, ["ar", "static:2", "static:4", "moe-aware"], ["mixed"], [{}], {}, static_best=True)

    shipped, heldout = one_batch(80, 125), one_batch(125, 80)  # static:2 best shipped, static:4 held-out
    assert "static-tuned" not in shipped["methods"]
    (tmp_path / "batch16_shipped.json").write_text(json.dumps(shipped))
    (tmp_path / "batch16_heldout.json").write_text(json.dumps(heldout))
    shipped_row, heldout_row = ([cell.strip() for cell in line.strip("|").split("|")]
                                for line in regime_table.table(tmp_path).splitlines()[2:])
    assert shipped_row[4] == "1.60x (static:4, other set)" and shipped_row[6] == "1.25"  # 125 ms against 100
    assert heldout_row[4] == "1.60x (static:2, other set)" and heldout_row[7] == "0.80"
    (tmp_path / "batch16_heldout.json").unlink()
    assert [cell.strip() for cell in regime_table.table(tmp_path).splitlines()[2].strip("|").split("|")][4] == "-"
