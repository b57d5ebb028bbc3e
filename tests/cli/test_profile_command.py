import argparse
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from moe_spec.errors import InputError
from moe_spec.profile.artifact import Profile
from moe_spec.cli.profile import add_arguments, read_prompts, run
from moe_spec.testing.tiny_models import tiny_model
from moe_spec.training.tokenizer_training import train_tokenizer

_TEXTS = ["def f(x):\n    return x + 1\n", "for i in range(10):\n    print(i)\n", "class A:\n    pass\n"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_target")
    tiny_model("deepseek_v3", vocab_size=300).save_pretrained(folder)
    train_tokenizer(_TEXTS * 4, vocab_size=300).save_pretrained(folder)
    return folder


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.slow  # profiles a target
def test_profile_command_end_to_end(tmp_path, model_dir, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": _TEXTS[i % 3] * 2}) for i in range(6)) + "\n")
    out = tmp_path / "out" / "profile.json"
    args = _args(
        "--model", str(model_dir), "--drafter", "lookup", "--prompts", str(prompts), "--out", str(out),
        "--plots", str(tmp_path / "plots"),
        "--max-new-tokens", "12", "--repeats", "2", "--warmup", "1", "--evict-mb", "8", "--threads", "1",
        "--grid-tokens", "1,4,16", "--grid-experts", "2,4,8", "--natural-trees", "6", "--prefix-len", "16",
        "--batch-sizes", "2,4",
    )
    record = run(args)
    stdout = capsys.readouterr().out.strip().splitlines()
    assert json.loads(stdout[-1]) == json.loads(json.dumps(record))
    assert "cost model" in "\n".join(stdout[:-1])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    profile = Profile.load(out, target=model)
    grid = profile.details["latency"]["grid"]
    assert {(p["T"], p["U"]) for p in grid} == {(1, 2), (4, 2), (4, 4), (4, 8), (16, 2), (16, 4), (16, 8)}
    assert profile.cost_model.num_layers == 2
    batched = profile.details["latency"]["batched_passes"]
    assert len(batched) == 16 and {row["split"] for row in batched} == {"batch-fit", "batch-heldout"}
    assert sorted({row["B"] for row in batched}) == [2, 4]
    assert all(row["B"] * row["width"] >= row["T"] for row in batched), "rows are padded to the widest tree"
    assert all(row["T"] >= row["B"] and len(row["U"]) == 2 for row in batched), "a root per row, union U per layer"
    report = profile.details["cost_model_report"]
    assert report["heldout_batched_error"]["n"] == report["heldout_batched_error_without_row_term"]["n"] == 8
    assert profile.cost_model.per_row_ms >= 0.0  # fitted: passes of 1, 2 and 4 rows
    assert record["heldout_batched_median_rel_error"] == report["heldout_batched_error"]["median"]
    assert "batched error" in "\n".join(stdout[:-1])
    assert profile.details["measurement"]["experts_implementation"] == "grouped_mm"
    assert profile.details["measurement"]["cold_weights"] is True
    assert profile.hardware["torch_threads"] == 1
    assert len(profile.details["expert_predictor"]["node_recall"]) == 2
    [arms] = profile.arm_rates  # greedy, one row, resident
    assert (arms.rows, arms.resident_experts, arms.sampling.temperature) == (1, None, 0.0)
    # an arm whose requests all ended within the settling steps has no rate (lookup copies fast here)
    assert "plain" in arms.rates and set(arms.rates) <= {"sized", "plain", "static:1", "static:2", "static:3",
                                                          "static:4", "static:6"}
    assert record["arm_rates"] == [arms.to_dict()]
    assert "arms, B=1" in "\n".join(stdout[:-1]) and "loop alignment" in "\n".join(stdout[:-1])
    assert profile.details["cost_model_report"]["loop_alignment"]["passes"] > 0
    for name in ("unique_experts_vs_tokens", "latency_heatmap", "cost_model_residuals", "expert_load"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 1000


def test_prompts_file_errors_name_the_problem(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n')
    with pytest.raises(InputError, match="no tokenizer"):
        read_prompts(path, None, 100)
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    with pytest.raises(InputError, match=r"p.jsonl:2: give exactly one of `prompt`"):
        read_prompts(path, None, 100)
    path.write_text('{"prompt_ids": [1, 200]}\n')
    with pytest.raises(InputError, match="outside"):
        read_prompts(path, None, 100)
    path.write_text("not json\n")
    with pytest.raises(InputError, match=":1: not JSON"):
        read_prompts(path, None, 100)


def test_missing_model_is_a_clear_error(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3]}\n')
    with pytest.raises(InputError, match="no model at"):
        run(_args("--model", str(tmp_path / "none"), "--prompts", str(prompts), "--out", str(tmp_path / "o.json")))


@pytest.mark.slow  # profiles a target
def test_profile_with_offload_measures_the_fetch_cost_and_checks_it_on_held_out_passes(tmp_path, model_dir, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": _TEXTS[i % 3] * 2}) for i in range(4)) + "\n")
    out = tmp_path / "profile.json"
    args = _args(
        "--model", str(model_dir), "--drafter", "lookup", "--prompts", str(prompts), "--out", str(out),
        "--max-new-tokens", "8", "--repeats", "1", "--warmup", "0", "--evict-mb", "0", "--threads", "1",
        "--grid-tokens", "1,4", "--grid-experts", "2,4", "--natural-trees", "2", "--prefix-len", "8", "--batch-sizes", "2",
        "--offload", "disk", "--resident-experts", "2", "--offload-dir", str(tmp_path / "store"),
    )
    record = run(args)
    assert "fetch error" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    profile = Profile.load(out, target=model)  # fingerprinted before the experts left the model
    fetch = profile.cost_model.fetch
    assert fetch is not None and fetch.num_layers == 2 and fetch.counts == (1, 2, 4, 8)
    assert all(v > 0 for row in fetch.ms for v in row)
    report = profile.details["fetch_cost_report"]
    assert report["passes"] > 0 and report["mean_misses_per_pass"] > 0
    assert record["fetch_error_median"] == report["error_refit_with_fetch_term"]["median"]
    assert report["fit_passes"] > 0 and report["heldout_passes"] > 0
    assert profile.cost_model.base_ms == report["refit_compute"]["base_ms"]
    assert (tmp_path / "store" / "experts.store").is_file()
