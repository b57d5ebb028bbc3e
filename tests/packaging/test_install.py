"""`pip install .` into an environment that already has torch leaves that torch alone, and the
installed package (its CLI and the embedded pair among its data files) works from there."""

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_installing_into_an_environment_with_torch_keeps_its_torch(tmp_path):
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"

    def pip(*args):
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]

    def torch_version() -> str:
        return subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                              text=True, check=True).stdout.strip()

    import torch

    pip(f"torch=={torch.__version__.split('+')[0]}")  # the user's torch (here: the one this suite runs on)
    before = torch_version()
    pip(str(ROOT))
    assert torch_version() == before, "pip install . replaced the environment's torch"
    cli = env_dir / "bin" / "moe-spec"
    version = subprocess.run([str(cli), "--version"], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert version.stdout.startswith("moe-spec ")
    done = subprocess.run([str(cli), "generate", "--prompt", "def add(a, b):", "--drafter", "lookup",
                           "--max-new-tokens", "4", "--json", "-"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["new_tokens"] == 4 and summary["device"] == "cpu"
    assert sys.executable != str(python)
