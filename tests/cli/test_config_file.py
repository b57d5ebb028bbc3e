"""`--config FILE`: YAML option values for every command, flags overriding, errors naming key and file."""

import argparse
import json
import re
from pathlib import Path

import pytest

from moe_spec.cli.main import COMMANDS, _command_parser, build_parser, main
from moe_spec.cli.config_file import ConfigError, load_config, parse_args
from moe_spec.core.sampling import SamplingConfig

from moe_spec.testing.helpers import REPETITIVE_PROMPT

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser(argv[0])
    return parse_args(parser, _command_parser(parser, argv[0]), argv)


def test_a_config_sets_defaults_and_flags_override_it(tmp_path, capsys):
    config = write(tmp_path / "tiny.yaml", f"arch: olmoe\nout: {tmp_path / 'from_file'}\nseed: 3\n")
    assert main(["make-tiny", "--config", str(config)]) == 0
    assert json.loads((tmp_path / "from_file" / "config.json").read_text())["model_type"] == "olmoe"
    assert main(["make-tiny", "--config", str(config), "--arch", "mixtral", "--out", str(tmp_path / "flag")]) == 0
    assert json.loads((tmp_path / "flag" / "config.json").read_text())["model_type"] == "mixtral"


def test_keys_take_dashes_or_underscores_and_values_go_through_the_options_types(tmp_path):
    config = write(tmp_path / "bench.yaml", "prompts: p.jsonl\nmax_new_tokens: 12\nwarmup-tokens: '3'\n"
                                            "methods: [ar, eagle2]\nno-progress: true\njson: out.json\ntemperature: 1\n")
    args = parse(["bench", "--config", str(config), "--limit", "1"])
    assert (args.prompts, args.max_new_tokens, args.warmup_tokens, args.limit) == ("p.jsonl", 12, 3, 1)
    assert args.methods == "ar,eagle2" and args.no_progress is True and args.json_out == "out.json"
    assert isinstance(args.temperature, float) and args.temperature == 1.0


def test_a_required_option_can_come_from_the_file_and_its_exclusive_partner_from_the_command_line(tmp_path):
    config = write(tmp_path / "gen.yaml", "prompt: hello\ndrafter: lookup\n")
    args = parse(["generate", "--config", str(config)])
    assert args.prompt == "hello"
    args = parse(["generate", "--config", str(config), "--prompt-ids", "1 2 3"])
    assert args.prompt is None and args.prompt_ids == "1 2 3", "a flag displaces the file's other group members"
    both = write(tmp_path / "both.yaml", "prompt: hello\nprompt-ids: '1 2'\n")
    with pytest.raises(ConfigError, match="exclude each other"):
        parse(["generate", "--config", str(both)])


def test_list_options_take_yaml_lists(tmp_path):
    config = write(tmp_path / "draft.yaml", "target: t\nout: o\nprompts: [a.txt, b.txt]\nminutes: 0.5\n")
    args = parse(["train-draft", "--config", str(config)])
    assert args.prompts == ["a.txt", "b.txt"] and args.minutes == 0.5


@pytest.mark.parametrize("text, message", [
    ("archh: olmoe\n", "unknown key 'archh'.*did you mean 'arch'"),
    ("seed: abc\n", "seed: --seed: expected an integer, got 'abc'"),
    ("seed: -1\n", r"seed: --seed: expected a seed in \[0, 2\*\*32\), got '-1'"),
    ("arch: nope\n", "'nope' is not a choice of --arch"),
    ("seed: true\n", "--seed takes a string or number"),
    ("config: other.yaml\n", "unknown key 'config'"),
    ("- arch\n- olmoe\n", "must hold a mapping"),
    ("arch: [unclosed\n", "not valid YAML"),
])
def test_bad_files_are_clear_errors_naming_the_file_and_the_key(tmp_path, capsys, text, message):
    config = write(tmp_path / "bad.yaml", text)
    assert main(["make-tiny", "--config", str(config), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "moe-spec make-tiny: error:" in err and str(config) in err
    assert re.search(message, err), err


def test_a_flag_needs_a_boolean(tmp_path):
    config = write(tmp_path / "bench.yaml", "prompts: p.jsonl\nno-progress: 1\n")
    with pytest.raises(ConfigError, match="--no-progress is a flag"):
        parse(["bench", "--config", str(config)])


def test_a_missing_config_file_is_a_clear_error(tmp_path, capsys):
    assert main(["make-tiny", "--config", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "m")]) == 2
    assert "cannot read config file" in capsys.readouterr().err


def _command_of(path: Path) -> str:
    """`bench_default.yaml` -> `bench`, `train_draft_default.yaml` -> `train-draft`: the longest command prefix."""
    stem = path.stem.replace("_", "-")
    return max((c for c in COMMANDS if stem.startswith(c + "-")), key=len)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_parses_against_its_command(path):
    command = _command_of(path)
    parser = build_parser(command)
    values = load_config(path, _command_parser(parser, command))
    assert values, f"{path.name} sets nothing"
    args = parse([command, "--config", str(path)])
    for dest, value in values.items():
        assert getattr(args, dest) == value


def test_the_default_bench_config_reproduces_the_default_bench():
    args = parse(["bench", "--config", str(CONFIGS / "bench_default.yaml")])
    assert args.methods == "ar,eagle2,static-best,truncate,moe-aware,moe-aware-noexperts"
    assert (args.prompts, args.limit, args.max_new_tokens, args.threads, args.temperature) == (
        "configs/bench/heldout.jsonl", 2, 48, None, 0.0)  # no thread flag: as a user runs it
    sampling = parse(["bench", "--config", str(CONFIGS / "bench_sampling.yaml")])
    assert sampling.sampling == [SamplingConfig(1.0), SamplingConfig(0.7, top_p=0.9)]
    assert sampling.methods == ("ar,eagle2@sampled,static-best@sampled,chain:2@sampled,chain:3@sampled,"
                                "chain:4@sampled,truncate,moe-aware,moe-aware-noexperts")
    assert sampling.temperature == 0.0


def test_generate_runs_from_a_config_file(tmp_path, capsys):
    model = tmp_path / "model"
    assert main(["make-tiny", "--arch", "qwen3_moe", "--out", str(model)]) == 0
    ids = " ".join(map(str, REPETITIVE_PROMPT))
    config = write(tmp_path / "gen.yaml", f"model: {model}\nprompt-ids: '{ids}'\ndrafter: lookup\nmax-new-tokens: 8\njson: '-'\n")
    assert main(["generate", "--config", str(config), "--max-new-tokens", "5"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["new_tokens"] == 5


def test_sampling_settings_are_yaml_mappings_checked_like_the_flag(tmp_path):
    config = write(tmp_path / "s.yaml", "prompts: p.jsonl\nsampling:\n  - {temperature: 1}\n  - {temperature: 0.7, top_p: 0.9, top_k: 40}\n")
    args = parse(["bench", "--config", str(config)])
    assert args.sampling == [SamplingConfig(1.0), SamplingConfig(0.7, top_k=40, top_p=0.9)]
    bad = write(tmp_path / "bad.yaml", "sampling:\n  - {temperature: 1, top_p: 1.5}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: sampling: --sampling: top_p must be a number in \(0, 1\], got 1.5"):
        parse(["bench", "--config", str(bad)])
    nan = write(tmp_path / "nan.yaml", "top-p: .nan\n")
    with pytest.raises(ConfigError, match=r"nan.yaml: top-p: --top-p: expected a finite number, got 'nan'"):
        parse(["bench", "--config", str(nan)])
