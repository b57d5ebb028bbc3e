"""The command line, run as a user would (in-process through `main`)."""

import json

import pytest

from moe_spec.cli.main import main
from moe_spec.policy.registry import METHODS, STATIC_GRID

from moe_spec.testing.helpers import REPETITIVE_PROMPT


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "qwen3_moe"
    assert main(["make-tiny", "--arch", "qwen3_moe", "--out", str(folder)]) == 0
    return folder


def test_generate_with_lookup_prints_a_summary_and_a_json_line(tiny_folder, capsys):
    ids = " ".join(map(str, REPETITIVE_PROMPT))
    code = main(["generate", "--model", str(tiny_folder), "--prompt-ids", ids, "--drafter", "lookup", "--max-new-tokens", "20", "--json", "-"])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "mean accepted length" in lines[-2]
    summary = json.loads(lines[-1])
    assert summary["new_tokens"] == len(summary["new_ids"]) <= 20
    # the prefill makes the first token, the steps the rest; the repetitive prompt gets drafts accepted
    assert summary["mean_accept_len"] == pytest.approx((summary["new_tokens"] - 1) / summary["steps"], abs=1e-3)
    assert summary["mean_accept_len"] > 1.0
    assert summary["unique_experts_per_layer"] > 0


def test_generate_reports_bad_input_as_a_clear_error(tiny_folder, capsys):
    code = main(["generate", "--model", str(tiny_folder), "--prompt", "hello", "--drafter", "lookup"])
    assert code == 2
    assert "has no tokenizer" in capsys.readouterr().err


def test_missing_model_folder_is_a_clear_error(tmp_path, capsys):
    code = main(["generate", "--model", str(tmp_path / "nothing"), "--prompt-ids", "1 2 3", "--drafter", "lookup"])
    assert code == 2
    assert "no model at" in capsys.readouterr().err


def test_generate_runs_every_registered_method_on_the_embedded_pair_with_ars_greedy_output(capsys):
    ids = " ".join(map(str, REPETITIVE_PROMPT))
    outputs = {}
    with_argument = {"static": f"static:{STATIC_GRID[0]}", "chain": "chain:3"}
    for method in [with_argument.get(name, name) for name in METHODS]:
        assert main(["generate", "--prompt-ids", ids, "--method", method, "--max-new-tokens", "8", "--json", "-"]) == 0, method
        lines = capsys.readouterr().out.strip().splitlines()
        assert f"[{method}, drafter default:" in lines[-2] and "mean accepted length" in lines[-2], method
        summary = json.loads(lines[-1])
        assert summary["method"] == method and summary["steps"] >= 1, method
        assert summary["new_tokens"] == len(summary["new_ids"]) == 8, method
        outputs[method] = summary["new_ids"]
    assert all(ids == outputs["ar"] for ids in outputs.values()), outputs


def test_generate_refuses_static_best_and_unknown_methods(capsys):
    assert main(["generate", "--prompt-ids", "1 2 3", "--method", "static-best"]) == 2
    assert "'static-best' is an aggregate" in capsys.readouterr().err
    assert main(["generate", "--prompt-ids", "1 2 3", "--method", "medusa"]) == 2
    assert "unknown method 'medusa'" in capsys.readouterr().err


def test_generate_method_that_prices_nodes_needs_a_profile_off_the_embedded_pair(tiny_folder, capsys):
    code = main(["generate", "--model", str(tiny_folder), "--prompt-ids", "1 2 3", "--drafter", "lookup",
                 "--method", "moe-aware"])
    assert code == 2
    assert "needs a profile of the target; pass --profile" in capsys.readouterr().err


def test_bench_without_profile_names_the_cached_profile_it_uses_on_stderr(tiny_folder, tmp_path, monkeypatch, capsys):
    import torch

    from moe_spec import LookupDrafter
    from moe_spec.core.target import TargetModel
    from moe_spec.loading import load_target, model_folder
    from moe_spec.measure.latency import TimingConfig
    from moe_spec.measure.profiler import ProfileSettings, build_profile
    from moe_spec.measure.store import cached_profile_path

    monkeypatch.setenv("MOE_SPEC_CACHE", str(tmp_path / "cache"))
    target = TargetModel(load_target(tiny_folder))
    quick = ProfileSettings(max_new_tokens=12, prefix_len=16, grid_tokens=(1, 4), grid_experts=(2, 4), natural_trees=4,
                            curve_sizes=(1, 2, 4), timing=TimingConfig(repeats=1, warmup=0, evict_mb=0))
    cached = cached_profile_path(target, f"{model_folder(tiny_folder)}|lookup")
    cached.parent.mkdir(parents=True)
    build_profile(target, LookupDrafter(), [torch.tensor(REPETITIVE_PROMPT), torch.tensor([9, 3, 9, 4] * 4)],
                  quick).save(cached)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": REPETITIVE_PROMPT}) + "\n")
    assert main(["bench", "--model", str(tiny_folder), "--drafter", "lookup", "--prompts", str(prompts),
                 "--methods", "ar,moe-aware", "--max-new-tokens", "4", "--warmup-tokens", "0", "--no-progress"]) == 0
    assert f"no --profile: using the cached profile {cached}" in capsys.readouterr().err
