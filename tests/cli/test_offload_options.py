"""`--offload` and its options on `generate` and `bench` (in-process through `main`), the runner's
cold cache per generation, the YAML keys, and `offload=` through `model.generate`."""

import argparse
import json
from pathlib import Path

import pytest
import torch

from moe_spec.cli.config_file import ConfigError, load_config
from moe_spec.cli.main import _command_parser, build_parser, main
from moe_spec.cli.offload_options import STORE_ROOT, add_offload_arguments, offload_config
from moe_spec.errors import InputError
from moe_spec.offload.expert_store import FILE_NAME

from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT

IDS = " ".join(map(str, REPETITIVE_PROMPT))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "qwen3_moe"
    assert main(["make-tiny", "--arch", "qwen3_moe", "--out", str(folder)]) == 0
    return folder


def options(*argv: str, model: str | None = None, dtype: str = "float32") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_offload_arguments(parser)
    return parser.parse_args(list(argv), argparse.Namespace(model=model, dtype=dtype))


def test_no_offload_options_mean_no_offload():
    assert offload_config(options()) is None


def test_defaults_are_offload_configs_and_the_store_is_named_by_model_folder_and_dtype(tiny_folder):
    config = offload_config(options("--offload", "disk", model=str(tiny_folder), dtype="bfloat16"))
    assert (config.tier, config.resident, config.cache, config.eviction.value, config.workers) == (
        "disk", 16, "resident", "lru", 4)
    assert Path(config.folder) == STORE_ROOT / "qwen3_moe-bfloat16"
    config = offload_config(options("--offload", "disk", "--resident-experts", "0", "--offload-dir", "here",
                                    "--offload-workers", "2", model=str(tiny_folder)))
    assert (config.resident, str(config.folder), config.workers) == (0, "here", 2)
    config = offload_config(options("--offload", "disk", "--eviction", "lfu", model=str(tiny_folder)))
    assert config.eviction.value == "lfu"
    assert (config.prefetch, config.layer_ahead) == (False, False)
    config = offload_config(options("--offload", "disk", "--prefetch", "--layer-ahead", model=str(tiny_folder)))
    assert (config.prefetch, config.layer_ahead) == (True, True)


@pytest.mark.parametrize("argv, message", [
    (["--resident-experts", "4"], "--resident-experts needs --offload"),
    (["--offload-dir", "x"], "--offload-dir needs --offload"),
    (["--eviction", "lfu"], "--eviction needs --offload"),
    (["--offload", "disk", "--offload-cache", "whole-layer", "--resident-experts", "4"],
     "--resident-experts has no effect with --offload-cache whole-layer"),
    (["--offload", "disk", "--offload-cache", "whole-layer", "--eviction", "lfu"], "--eviction has no effect"),
    (["--offload", "disk", "--resident-experts", "0", "--eviction", "lru"], "--eviction has no effect"),
    (["--layer-ahead"], "--layer-ahead needs --offload"),
    (["--offload", "disk", "--offload-cache", "whole-layer", "--layer-ahead"], "--layer-ahead has no effect"),
    (["--offload", "disk", "--resident-experts", "0", "--layer-ahead"], "--layer-ahead has no effect"),
    (["--offload", "disk", "--offload-cache", "whole-layer", "--prefetch"], "--prefetch has no effect"),
    (["--offload", "disk", "--resident-experts", "0", "--prefetch"], "--prefetch has no effect"),
])
def test_options_that_would_go_unused_are_refused_by_name(argv, message, tiny_folder):
    with pytest.raises(InputError, match=message):
        offload_config(options(*argv, model=str(tiny_folder)))


@pytest.mark.parametrize("argv, message", [
    (["--offload", "disk", "--resident-experts", "-1"], "argument --resident-experts: expected an integer >= 0"),
    (["--offload", "disk", "--resident-experts", "many"], "argument --resident-experts: expected an integer"),
    (["--offload", "tape"], "argument --offload: invalid choice: 'tape'"),
    (["--offload", "disk", "--offload-workers", "0"], "argument --offload-workers: expected an integer >= 1"),
    (["--offload", "disk", "--eviction", "fifo"], "argument --eviction: invalid choice"),
])
def test_bad_values_are_named_on_the_command_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt-ids", "1 2", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_an_option_without_offload_is_an_error_of_the_command(tiny_folder, capsys):
    assert main(["generate", "--model", str(tiny_folder), "--prompt-ids", "1 2", "--resident-experts", "4"]) == 2
    assert "--resident-experts needs --offload" in capsys.readouterr().err


def test_tier_host_on_the_cpu_is_a_clear_error(tiny_folder, tmp_path, capsys):
    argv = ["generate", "--model", str(tiny_folder), "--prompt-ids", "1 2", "--offload", "host",
            "--offload-dir", str(tmp_path / "store")]
    assert main(argv) == 2
    assert "needs the model on a CUDA device" in capsys.readouterr().err


def generate(capsys, tiny_folder, *extra: str) -> tuple[list[str], dict]:
    argv = ["generate", "--model", str(tiny_folder), "--prompt-ids", IDS, "--drafter", "lookup",
            "--max-new-tokens", "12", "--json", "-", *extra]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return lines, json.loads(lines[-1])


def test_generate_offloaded_decodes_the_same_tokens_and_reports_its_reads(tiny_folder, tmp_path, capsys):
    _, plain = generate(capsys, tiny_folder)
    assert plain["offload"] is None and plain["misses_per_token"] == 0
    store = tmp_path / "store"
    lines, offloaded = generate(capsys, tiny_folder, "--offload", "disk", "--resident-experts", "4",
                                "--offload-dir", str(store))
    assert offloaded["new_ids"] == plain["new_ids"] and lines[0] == _text(plain)
    assert offloaded["misses_per_token"] > 0 and offloaded["bytes_read_per_token"] > 0
    assert 0 < offloaded["hit_rate"] < 1
    summary = offloaded["offload"]
    assert (summary["tier"], summary["resident_experts"], summary["cache"]) == ("disk", 4, "resident")
    assert summary["store"] == str(store / FILE_NAME) and summary["experts_mb"] > 0
    assert isinstance(summary["direct_reads"], bool)
    assert lines[-3].startswith("experts offloaded: disk, 4 resident, lru")
    assert "experts read per token" in lines[-2] and "hit rate" in lines[-2]

    # the store is written once: a second run reads it (C = 0: every pass reads each expert it uses)
    written = (store / FILE_NAME).stat().st_mtime_ns
    _, uncached = generate(capsys, tiny_folder, "--offload", "disk", "--resident-experts", "0",
                           "--offload-dir", str(store))
    assert (store / FILE_NAME).stat().st_mtime_ns == written
    assert uncached["new_ids"] == plain["new_ids"]
    assert uncached["hit_rate"] == 0 and uncached["misses_per_token"] > offloaded["misses_per_token"]


def _text(summary: dict) -> str:
    return " ".join(map(str, summary["new_ids"]))  # the tiny folder has no tokenizer: ids are printed


def test_bench_offloaded_reports_reads_per_method_and_class_and_the_offload(tiny_folder, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"class": "copy", "prompt_ids": REPETITIVE_PROMPT}) + "\n"
                       + json.dumps({"class": "plain", "prompt_ids": PLAIN_PROMPT}) + "\n")
    out = tmp_path / "report.json"
    argv = ["bench", "--model", str(tiny_folder), "--drafter", "lookup", "--prompts", str(prompts),
            "--methods", "ar,static:4", "--max-new-tokens", "8", "--warmup-tokens", "2", "--no-progress",
            "--offload", "disk", "--resident-experts", "4", "--offload-dir", str(tmp_path / "store"),
            "--json", str(out), "--plots", str(tmp_path / "plots")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    tables = [block for block in printed.split("\n\n") if "method" in block]
    assert len(tables) == 3  # all prompts, then each class
    for table in tables:
        header = table.splitlines()[1]
        assert "miss/tok" in header and "MB/tok" in header and "hit %" in header
    line = json.loads(printed.strip().splitlines()[-1])
    assert line["offload"]["tier"] == "disk" and line["offload"]["resident_experts"] == 4
    for method in ("ar", "static:4"):
        assert line["methods"][method]["misses_per_token"] > 0
        assert line["methods"][method]["mismatches"] == 0  # offloading is lossless
    report = json.loads(out.read_text())
    assert report["config"]["offload"] == line["offload"]
    assert "--offload disk --resident-experts 4" in report["config"]["command"]
    for table in report["per_class"].values():
        assert all(f["misses_per_token"] > 0 and f["mb_read_per_token"] > 0 for f in table.values())
    assert len(report["config"]["plots"]) >= 1


def offloaded_runs(folder: Path, store: Path, spy=None):
    """ar and static:4 on two prompts, two passes, through `run_methods` on an offloaded target (C = 4)."""
    from moe_spec import LookupDrafter
    from moe_spec.core.target import TargetModel
    from moe_spec.experiments.runner import RunSettings, run_methods
    from moe_spec.loading import load_target
    from moe_spec.offload.offloaded_experts import OffloadConfig, offload_experts
    from moe_spec.policy.registry import MethodContext, build_method

    model = load_target(folder)
    offload = offload_experts(model, OffloadConfig(store, resident=4))
    if spy is not None:
        spy(offload)
    target = TargetModel(model, offload=offload)
    context = MethodContext(target, LookupDrafter, None)
    methods = [build_method(name, context) for name in ("ar", "static:4")]
    prompts = [torch.tensor([REPETITIVE_PROMPT]), torch.tensor([PLAIN_PROMPT])]
    try:
        return run_methods(target, methods, prompts, RunSettings(max_new_tokens=6, warmup_tokens=2, repeats=2),
                           progress=False)
    finally:
        offload.close()


def test_every_generation_of_every_method_starts_from_an_empty_cache(tiny_folder, tmp_path, monkeypatch):
    resident_after_clear = []

    def spy(offload):
        clear = offload.clear

        def spying_clear():
            clear()
            resident_after_clear.append(int(offload.residency().sum()))

        monkeypatch.setattr(offload, "clear", spying_clear)

    runs = offloaded_runs(tiny_folder, tmp_path / "store", spy)
    assert len(runs) == 8
    assert len(resident_after_clear) == 2 + len(runs) and not any(resident_after_clear)  # 2 warm-ups, then the runs


def test_a_cold_start_reads_the_same_experts_on_every_pass(tiny_folder, tmp_path):
    runs = offloaded_runs(tiny_folder, tmp_path / "store")
    for method in ("ar", "static:4"):
        for index in (0, 1):
            misses = [sum(s.expert_misses for s in r.stats.steps) for r in runs
                      if r.method == method and r.prompt_index == index]
            assert len(misses) == 2 and misses[0] == misses[1] > 0, (method, index, misses)


def test_yaml_config_keys_are_the_offload_options(tiny_folder, tmp_path):
    parser = build_parser("generate")
    command = _command_parser(parser, "generate")
    config = tmp_path / "generate.yaml"
    config.write_text("offload: disk\nresident-experts: 4\noffload_dir: store\noffload-cache: resident\n"
                      "eviction: lfu\noffload-workers: 2\n")
    assert load_config(config, command) == {"offload": "disk", "resident_experts": 4, "offload_dir": "store",
                                            "offload_cache": "resident", "eviction": "lfu", "offload_workers": 2}
    config.write_text("offload: disk\nresident-experts: -2\n")
    with pytest.raises(ConfigError, match="resident-experts: --resident-experts: expected an integer >= 0"):
        load_config(config, _command_parser(build_parser("bench"), "bench"))


def test_model_generate_takes_the_offload_and_counts_its_reads(tmp_path):
    from moe_spec import LookupDrafter
    from moe_spec.integrations.hf_generate import speculative_generate
    from moe_spec.offload.offloaded_experts import OffloadConfig, offload_experts
    from moe_spec.testing.tiny_models import tiny_model

    model = tiny_model("qwen3_moe")
    ids = torch.tensor([REPETITIVE_PROMPT])
    expected = model.generate(ids, do_sample=False, max_new_tokens=8)
    offload = offload_experts(model, OffloadConfig(tmp_path / "store", resident=4))
    try:
        out = model.generate(ids, custom_generate=speculative_generate, drafter=LookupDrafter(), offload=offload,
                             do_sample=False, max_new_tokens=8)
        assert torch.equal(out, expected)
        assert offload.counters.misses > 0
        with pytest.raises(InputError, match="offload= must be the ExpertOffload"):
            model.generate(ids, custom_generate=speculative_generate, offload="disk", max_new_tokens=2)
        with pytest.raises(InputError, match="offload= is not installed on this model"):
            other = tiny_model("qwen3_moe")
            other.generate(ids, custom_generate=speculative_generate, offload=offload, max_new_tokens=2)
    finally:
        offload.close()
