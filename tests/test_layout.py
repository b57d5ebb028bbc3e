"""The package's layout as docs/design.md states it: each folder imports only from the layers
below it (so no two folders import each other), and no function runs past 80 lines."""

import ast
from pathlib import Path

import moe_spec

PACKAGE = Path(moe_spec.__file__).parent
# lowest first, as docs/design.md lists them; `testing/` (test helpers) may import any layer
LAYERS = ("core", "profile", "offload", "drafters", "policy", "measure", "training", "experiments",
          "integrations", "cli")
MAX_FUNCTION_LINES = 80


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def _imported(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, node.lineno
        elif isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)


def test_every_layer_imports_only_from_the_layers_below_it():
    rank = {layer: index for index, layer in enumerate(LAYERS)}
    upward = []
    for path, tree in _modules():
        layer = path.relative_to(PACKAGE).parts[0]
        if layer not in rank:
            continue
        for module, line in _imported(tree):
            parts = module.split(".")
            if parts[0] == "moe_spec" and len(parts) > 1 and rank.get(parts[1], -1) > rank[layer]:
                upward.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_the_design_notes_list_the_layers_in_this_order():
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    table = [line.split("`")[1].rstrip("/") for line in design.splitlines() if line.startswith("| `") and "/` |" in line]
    assert tuple(layer for layer in table if layer in LAYERS) == LAYERS


def test_no_function_runs_past_80_lines():
    long = [f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in _modules() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, "\n".join(long)
