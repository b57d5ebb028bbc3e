"""The analysis notebooks run top to bottom on real (tiny-model) profile and bench output, and draw."""

import json
from pathlib import Path

import nbclient
import nbformat
import pytest

from moe_spec.cli.main import main
from moe_spec.testing.tiny_models import tiny_model

from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT

pytestmark = pytest.mark.slow  # executes the notebooks

ANALYSIS = Path(__file__).resolve().parent.parent / "analysis"
QUICK_PROFILE = ["--max-new-tokens", "12", "--repeats", "2", "--warmup", "1", "--evict-mb", "0", "--threads", "1",
                 "--grid-tokens", "1,4,16", "--grid-experts", "2,4,8", "--natural-trees", "6", "--prefix-len", "16"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("analysis")
    model = root / "model"
    tiny_model("qwen3_moe").save_pretrained(model)
    prompts = root / "prompts.jsonl"
    rows = [("copy", REPETITIVE_PROMPT), ("code", PLAIN_PROMPT), ("copy", REPETITIVE_PROMPT[2:] * 2), ("code", PLAIN_PROMPT[::-1])]
    prompts.write_text("".join(json.dumps({"class": c, "prompt_ids": p}) + "\n" for c, p in rows))
    out = root / "results"
    assert main(["profile", "--model", str(model), "--drafter", "lookup", "--prompts", str(prompts),
                 "--out", str(out / "profile.json"), *QUICK_PROFILE]) == 0
    assert main(["bench", "--model", str(model), "--drafter", "lookup", "--prompts", str(prompts),
                 "--methods", "ar,eagle2,static:4,moe-aware,moe-aware-noexperts", "--profile", str(out / "profile.json"),
                 "--max-new-tokens", "12", "--threads", "1", "--no-progress", "--json", str(out / "bench_greedy.json")]) == 0
    _offload_results(model, prompts, out / "offload", root / "store")
    return out


def _offload_results(model, prompts, out, store):
    """What notebook 04 reads: offloaded benches at two cache sizes, the fetch profile, the peers."""
    import subprocess
    import sys

    for resident in (2, 4):
        assert main(["bench", "--model", str(model), "--drafter", "lookup", "--prompts", str(prompts),
                     "--methods", "ar,static:4,moe-aware,moe-aware-noresidency", "--profile", str(out.parent / "profile.json"),
                     "--max-new-tokens", "8", "--threads", "1", "--no-progress", "--offload", "disk",
                     "--resident-experts", str(resident), "--offload-dir", str(store),
                     "--json", str(out / f"bench_tiny_c{resident}.json")]) == 0
    root = Path(__file__).resolve().parent.parent
    for script, extra in (("profile_fetch.py", ["--profile", str(out.parent / "profile.json"), "--drafter", "lookup",
                                                 "--resident-experts", "2", "--max-new-tokens", "6",
                                                 "--out", str(out / "profile_disk.json")]),
                          ("offload_peers.py", ["--resident", "2", "4", "--max-new-tokens", "6", "--limit", "1",
                                                "--json", str(out / "peers_tiny.json")])):
        subprocess.run([sys.executable, str(root / "scripts" / script), "--model", str(model), "--prompts", str(prompts),
                        *(["--offload-dir", str(store)] if script == "profile_fetch.py" else ["--store", str(store)]),
                        *extra], check=True, capture_output=True)


@pytest.mark.parametrize(
    "notebook,figures",
    [
        ("01_expert_activation", ["expert_load.png", "token_id_concentration.png", "unique_experts_vs_tokens.png", "coactivation.png"]),
        ("02_cost_model", ["latency_grid.png", "cost_model_residuals.png"]),
        ("03_speedups", ["speedup_by_class.png", "accept_vs_cost.png", "moe_aware_tree_sizes.png", "speedup_vs_batch.png"]),
        ("04_offload", ["offload_speedup_vs_resident.png", "offload_misses_per_token.png", "offload_cost_fit.png",
                        "offload_peers_tiny.png"]),
    ],
)
def test_notebook_runs_and_draws(notebook, figures, results, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SPEC_RESULTS", str(results))
    monkeypatch.setenv("MOE_SPEC_FIGURES", str(tmp_path / "figures"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    book = nbformat.read(ANALYSIS / f"{notebook}.ipynb", as_version=4)
    # one cell more, run after the notebook's own: the folder the notebook read its results from
    book.cells.append(nbformat.v4.new_code_cell("print('results from', RESULTS.resolve())"))
    nbclient.NotebookClient(book, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(ANALYSIS)}}).execute()
    for name in figures:
        assert (tmp_path / "figures" / name).stat().st_size > 1000, name
    printed = "".join(output.get("text", "") for output in book.cells[-1].outputs)
    read = Path(printed.strip().removeprefix("results from "))
    assert read == results.resolve() or results.resolve() in read.parents, "it read this run's results, not the shipped ones"
