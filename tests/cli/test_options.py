"""Every option's value is checked while the command line is parsed (`moe_spec.cli.option_types`),
before a model is loaded; sampling options reach decoding."""

import json

import pytest

from moe_spec.cli.main import main
from moe_spec.testing.helpers import REPETITIVE_PROMPT
from moe_spec.testing.tiny_models import tiny_model


@pytest.mark.parametrize("argv, message", [
    (["generate", "--temperature", "nan"], "argument --temperature: expected a finite number, got 'nan'"),
    (["generate", "--temperature", "-0.5"], "argument --temperature: temperature must be a finite number >= 0"),
    (["generate", "--temperature", "1e-9"], "argument --temperature: temperature must be 0 (greedy) or at least 1e-06"),
    (["generate", "--top-p", "1.5"], "argument --top-p: top_p must be a number in (0, 1], got 1.5"),
    (["generate", "--top-p", "nan"], "argument --top-p: expected a finite number, got 'nan'"),
    (["generate", "--top-k", "2.5"], "argument --top-k: expected an integer, got '2.5'"),
    (["generate", "--top-k", "-1"], "argument --top-k: top_k must be an integer >= 0"),
    (["generate", "--max-new-tokens", "0"], "argument --max-new-tokens: expected an integer >= 1, got '0'"),
    (["generate", "--seed", "-1"], "argument --seed: expected a seed in [0, 2**32), got '-1'"),
    (["generate", "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (["generate", "--experts-implementation", "fast"], "argument --experts-implementation: unknown experts implementation 'fast'"),
    (["bench", "--top-k", "x"], "argument --top-k: expected an integer, got 'x'"),
    (["bench", "--top-p", "0"], "argument --top-p: top_p must be a number in (0, 1], got 0.0"),
    (["bench", "--sampling", "temperature=-1"], "argument --sampling: temperature must be a finite number >= 0"),
    (["bench", "--sampling", "temp=1"], "argument --sampling: expected key=value pairs of temperature, top_k, top_p"),
    (["bench", "--sampling", "top_k=1,top_k=2"], "argument --sampling: top_k is set twice"),
    (["bench", "--batch-size", "0"], "argument --batch-size: expected an integer >= 1"),
    (["bench", "--limit", "0"], "argument --limit: expected an integer >= 1"),
    (["bench", "--warmup-tokens", "-1"], "argument --warmup-tokens: expected an integer >= 0"),
    (["bench", "--threads", "0"], "argument --threads: expected an integer >= 1"),
    (["bench", "--device", "toaster"], "argument --device: not a torch device: 'toaster'"),
    (["demo", "--top-k", "-2"], "argument --top-k: top_k must be an integer >= 0"),
    (["demo", "--temperature", "inf"], "argument --temperature: expected a finite number, got 'inf'"),
    (["demo", "--max-new-tokens", "-3"], "argument --max-new-tokens: expected an integer >= 1"),
    (["profile", "--repeats", "0"], "argument --repeats: expected an integer >= 1"),
    (["profile", "--evict-mb", "-8"], "argument --evict-mb: expected an integer >= 0"),
    (["simulate", "--per-expert-scale", "1,nan"], "argument --per-expert-scale: expected positive numbers"),
    (["simulate", "--bytes-per-param", "0"], "argument --bytes-per-param: expected a finite number > 0"),
    (["train-draft", "--minutes", "0"], "argument --minutes: expected a finite number > 0"),
    (["train-draft", "--head-intermediate", "-1"], "argument --head-intermediate: expected an integer >= 0"),
    (["train-draft", "--sampled-share", "1.5"], "argument --sampled-share: expected a number in [0, 1]"),
    (["train-draft", "--random-prompt-share", "-0.1"], "argument --random-prompt-share: expected a number in [0, 1]"),
    (["train-draft", "--repeat-prompt-share", "2"], "argument --repeat-prompt-share: expected a number in [0, 1]"),
    (["train-draft", "--prompt-len", "1"], "argument --prompt-len: expected at least 2 tokens"),
    (["train-target", "--checkpoint-every-s", "inf"], "argument --checkpoint-every-s: expected a finite number"),
    (["make-tiny", "--seed", "4294967296"], "argument --seed: expected a seed in [0, 2**32)"),
])
def test_a_bad_option_value_is_refused_while_parsing_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("options") / "qwen3_moe"
    tiny_model("qwen3_moe").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("prompt_ids, message", [
    ("", "--prompt-ids is empty"),
    ("5 six 7", "--prompt-ids must be integer token ids separated by spaces, got '5 six 7'"),
    ("5 -6", "--prompt-ids must be token ids >= 0, got -6"),
    ("5 500 7", "--prompt-ids has token ids outside the model's vocabulary [0, 96): [500]"),
])
def test_bad_prompt_ids_are_named(tiny_folder, prompt_ids, message, capsys):
    assert main(["generate", "--model", str(tiny_folder), f"--prompt-ids={prompt_ids}", "--drafter", "lookup"]) == 2
    assert message in capsys.readouterr().err


def test_an_empty_prompt_is_named_as_such_not_as_an_empty_batch_row(capsys):
    assert main(["generate", "--prompt", ""]) == 2
    err = capsys.readouterr().err
    assert "--prompt is empty" in err and "attention_mask" not in err


def _generate(tiny_folder, capsys, *options) -> list[int]:
    ids = " ".join(map(str, REPETITIVE_PROMPT[:6]))
    argv = ["generate", "--model", str(tiny_folder), "--prompt-ids", ids, "--drafter", "lookup", "--max-new-tokens", "12",
            "--json", "-", *options]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["new_ids"]


def test_generate_passes_top_k_and_top_p_to_decoding(tiny_folder, capsys):
    greedy = _generate(tiny_folder, capsys)
    sampled = _generate(tiny_folder, capsys, "--temperature", "1")
    assert sampled != greedy, "at temperature 1 the tiny model's continuation is not its greedy one"
    assert _generate(tiny_folder, capsys, "--temperature", "1", "--top-k", "1") == greedy  # top-1: the argmax
    assert _generate(tiny_folder, capsys, "--temperature", "1", "--top-p", "1e-6") == greedy  # the top token's mass


def _bench(tiny_folder, tmp_path, *options) -> dict:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"class": c, "prompt_ids": p}) + "\n"
                               for c, p in [("copy", REPETITIVE_PROMPT), ("plain", [9, 8, 7, 6])]))
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(tiny_folder), "--drafter", "lookup", "--prompts", str(prompts),
                 "--methods", "ar,static:4", "--max-new-tokens", "10", "--warmup-tokens", "0", "--no-progress",
                 "--json", str(out), *options]) == 0
    return json.loads(out.read_text())


def _new_ids(report: dict) -> list[list[int]]:
    return [p["methods"][m]["new_ids"] for p in report["per_prompt"] for m in ("ar", "static:4")]


def test_bench_reports_several_sampling_settings_side_by_side(tiny_folder, tmp_path, capsys):
    report = _bench(tiny_folder, tmp_path, "--sampling", "temperature=0", "temperature=1,top_k=1", "temperature=1")
    out = capsys.readouterr().out
    labels = ["temperature=0", "temperature=1,top_k=1", "temperature=1"]
    assert report["sampling"] == labels and list(report["reports"]) == labels
    for label, one in report["reports"].items():
        assert f"=== sampling {label} ===" in out
        assert set(one["methods"]) == {"ar", "static:4"}
    configs = [one["config"] for one in report["reports"].values()]
    assert [(c["temperature"], c["top_k"], c["top_p"]) for c in configs] == [(0.0, 0, 1.0), (1.0, 1, 1.0), (1.0, 0, 1.0)]
    assert "sampling settings side by side" in out and "temperature=1,top_k=1 speedup" in out
    greedy, top_1, sampled = (_new_ids(one) for one in report["reports"].values())
    assert top_1 == greedy and sampled != greedy  # top_k reached decoding
    line = json.loads(out.strip().splitlines()[-1])
    assert line["command"] == "bench" and list(line["sampling"]) == labels
    assert "--sampling temperature=0 temperature=1,top_k=1 temperature=1" in configs[0]["command"]


def test_bench_takes_top_k_and_top_p_for_one_setting(tiny_folder, tmp_path):
    greedy = _bench(tiny_folder, tmp_path)
    top_1 = _bench(tiny_folder, tmp_path, "--temperature", "1", "--top-k", "1", "--top-p", "0.9")
    assert (top_1["config"]["top_k"], top_1["config"]["top_p"]) == (1, 0.9)
    assert _new_ids(top_1) == _new_ids(greedy) and "sampling" not in top_1


@pytest.mark.parametrize("options, message", [
    (["--sampling", "temperature=1", "--temperature", "0.5"], "--sampling replaces --temperature, --top-k and --top-p"),
    (["--sampling", "temperature=1", "temperature=1.0"], "--sampling lists temperature=1 more than once"),
    (["--sampling", "temperature=1", "temperature=0.7", "--trace", "t.jsonl"], "--trace records one sampling setting"),
])
def test_bench_refuses_ambiguous_sampling_before_loading(options, message, capsys):
    assert main(["bench", "--prompts", "nothing.jsonl", *options]) == 2
    assert message in capsys.readouterr().err
