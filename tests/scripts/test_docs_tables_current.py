"""docs/measurements.md's regime and replayed tables are what their scripts make of the committed
results (`analysis/results/controller_regimes`): a results file re-measured without its table
remade, or a table edited by hand, fails here."""

import contextlib
import importlib.util
import io
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "analysis/results/controller_regimes"
DOC = (ROOT / "docs/measurements.md").read_text()


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _missing(lines: list[str]) -> list[str]:
    return [line for line in lines if line not in DOC.splitlines()]


def test_the_regime_table_is_the_committed_results():
    lines = _script("regime_table").table(RESULTS).splitlines()
    assert len(lines) > 2 + 20, "every regime's row on both sets"
    assert _missing(lines) == []


def test_the_replayed_table_is_the_committed_results():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert _script("simulate_table").main([str(RESULTS)]) == 0
    lines = out.getvalue().splitlines()[:-1]  # the last line is the JSON
    assert len(lines) == 2 + 12, "six regimes on both sets"
    assert _missing(lines) == []
