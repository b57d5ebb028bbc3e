"""No file moe_spec reads is unpickled: a checkpoint, profile, trace, head or config from elsewhere
is data, never code. Checked on the source (AST), so a new `torch.load` anywhere fails here."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SOURCES = sorted([*(ROOT / "moe_spec").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")])
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal", "torch.serialization"}
UNSAFE_CALLS = {"torch.load", "pickle.load", "pickle.loads", "pandas.read_pickle", "pd.read_pickle", "yaml.load",
                "yaml.unsafe_load", "yaml.full_load", "yaml.load_all", "yaml.unsafe_load_all", "numpy.load", "np.load"}
SAFE_WHEN = {"numpy.load": "allow_pickle", "np.load": "allow_pickle"}  # np.load is safe with allow_pickle=False


def _dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def unsafe_reads(source: str, filename: str = "<source>") -> list[str]:
    """Each place in `source` that can unpickle: pickle-family imports, torch.load, yaml.load,
    np.load without allow_pickle=False, any allow_pickle or weights_only that is not the safe constant."""
    found = []
    imported = {}  # local name -> what it is
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in UNSAFE_MODULES or alias.name.split(".")[0] in UNSAFE_MODULES:
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in UNSAFE_MODULES or node.module.split(".")[0] in UNSAFE_MODULES:
                found.append(f"{where}: from {node.module} import ...")
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            name = imported.get(name, name)
            keywords = {k.arg: k.value for k in node.keywords}
            for flag, safe in (("allow_pickle", False), ("weights_only", True)):
                if flag in keywords and not (isinstance(keywords[flag], ast.Constant) and keywords[flag].value is safe):
                    found.append(f"{where}: {name}(..., {flag}={ast.unparse(keywords[flag])})")
            if name in UNSAFE_CALLS:
                flag = SAFE_WHEN.get(name)
                value = keywords.get(flag) if flag else None
                if not (isinstance(value, ast.Constant) and value.value is False):
                    found.append(f"{where}: {name}(...)")
    return found


def test_the_package_and_scripts_never_unpickle():
    assert SOURCES, "no sources found"
    found = [hit for path in SOURCES for hit in unsafe_reads(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "reads that can unpickle (a file would be code):\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    "import torch\nstate = torch.load(path, map_location='cpu', weights_only=False)",
    "import torch\nstate = torch.load(path)",
    "from torch import load\nload(path)",
    "import pickle\npickle.loads(blob)",
    "from pickle import loads",
    "import numpy as np\nnp.load(path, allow_pickle=True)",
    "import numpy as np\nnp.load(path)",
    "import numpy\nnumpy.lib.format.read_array(f, allow_pickle=flag)",
    "import yaml\nyaml.load(text, Loader=yaml.Loader)",
    "import joblib",
])
def test_the_check_finds_each_kind_of_unpickling(source):
    assert unsafe_reads(source)


@pytest.mark.parametrize("source", [
    "import numpy as np\nnp.load(path, allow_pickle=False)",
    "import yaml\nyaml.safe_load(text)",
    "from safetensors.torch import load_file\nload_file(path)",
    "import json\njson.loads(text)",
])
def test_the_check_passes_safe_reads(source):
    assert not unsafe_reads(source)
