"""Every code block of the README and of docs/*.md runs, unless it is marked `<!-- skip-test: reason -->`
just above it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the README's commands, profiling included

ROOT = Path(__file__).resolve().parent.parent
# a block may sit indented in a list item, its skip marker indented the same
BLOCK = re.compile(r"(<!-- skip-test: (?P<reason>[^>]*) -->\n[ \t]*)?```(?P<lang>python|bash)\n(?P<code>.*?)```", re.S)


DOCUMENTS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))


def _blocks(document: str = "README.md"):
    text = (ROOT / document).read_text()
    return [(m.group("lang"), m.group("code"), m.group("reason")) for m in BLOCK.finditer(text)]


def test_the_readme_starts_with_the_two_fresh_machine_commands():
    lang, code, _ = _blocks()[0]
    lines = [line.split("#")[0].strip() for line in code.strip().splitlines()]
    assert lang == "bash" and lines == ["make demo", "make test"]


@pytest.mark.parametrize(("document", "index"), [(d, i) for d in DOCUMENTS for i in range(len(_blocks(d)))])
def test_readme_block_runs(document, index, tmp_path):
    lang, code, skip_reason = _blocks(document)[index]
    if skip_reason:
        pytest.skip(skip_reason)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{document} block {index} failed:\n{code}\n--- stderr ---\n{done.stderr[-3000:]}"
