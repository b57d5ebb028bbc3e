"""The docs' tables of measured results are what their scripts make of the committed results:
docs/measurements.md's regime and replayed tables (`analysis/results/controller_regimes`) and
docs/drafters.md's drafter table (`analysis/results/drafters`). A results file re-measured without
its table remade, or a table edited by hand, fails here."""

import contextlib
import importlib.util
import io
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "analysis/results/controller_regimes"
DOC = (ROOT / "docs/measurements.md").read_text()
DRAFTERS_DOC = (ROOT / "docs/drafters.md").read_text()


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _missing(lines: list[str], doc: str = DOC) -> list[str]:
    return [line for line in lines if line not in doc.splitlines()]


def _printed(module, argv: list[str]) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert module.main(argv) in (0, None)
    return out.getvalue().splitlines()


def test_the_regime_table_is_the_committed_results():
    lines = _script("regime_table").table(RESULTS).splitlines()
    assert len(lines) > 2 + 20, "every regime's row on both sets"
    assert _missing(lines) == []


def test_the_replayed_table_is_the_committed_results():
    lines = _printed(_script("simulate_table"), [str(RESULTS)])[:-1]  # the last line is the JSON
    assert len(lines) == 2 + 12, "six regimes on both sets"
    assert _missing(lines) == []


def test_the_drafter_table_is_the_committed_results():
    lines = [line for line in _printed(_script("drafter_table"), ["--results", str(ROOT / "analysis/results/drafters")])
             if line.startswith("|")]
    assert len(lines) == 2 + 16, "four drafters, two settings, both sets"
    assert _missing(lines, DRAFTERS_DOC) == []
