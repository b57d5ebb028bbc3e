"""--device, --dtype and --device-map on every command that loads a model; --version; help texts
that show every option's default and hide none."""

import json

import pytest
import torch

from moe_spec.cli.main import COMMANDS, HelpWithDefaults, build_parser, _command_parser, main
from moe_spec.cli.model_options import checkpoint_dtype
from moe_spec.testing.helpers import REPETITIVE_PROMPT

MODEL_COMMANDS = ("generate", "demo", "bench", "profile", "soak")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "qwen3_moe"
    assert main(["make-tiny", "--arch", "qwen3_moe", "--out", str(folder)]) == 0
    return folder


def _generate(folder, capsys, *options):
    ids = " ".join(map(str, REPETITIVE_PROMPT))
    assert main(["generate", "--model", str(folder), "--prompt-ids", ids, "--drafter", "lookup", "--max-new-tokens", "8",
                 "--json", "-", *options]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_auto_is_the_cpu_in_float32_here_and_each_dtype_can_be_asked_for(tiny_folder, capsys):
    assert not torch.cuda.is_available(), "this test describes a machine without CUDA"
    auto = _generate(tiny_folder, capsys)
    assert (auto["device"], auto["dtype"]) == ("cpu", "float32")
    assert _generate(tiny_folder, capsys, "--device", "cpu", "--dtype", "float32")["new_ids"] == auto["new_ids"]
    for dtype in ("bfloat16", "float16"):
        summary = _generate(tiny_folder, capsys, "--device", "cpu", "--dtype", dtype)
        assert summary["dtype"] == dtype and len(summary["new_ids"]) == 8


def test_a_device_this_machine_lacks_is_refused_by_name(tiny_folder, capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tiny_folder), "--prompt-ids", "1 2", "--device", "cuda"])
    assert "CUDA is not available" in capsys.readouterr().err


def test_auto_dtype_reads_the_checkpoints_own(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    assert checkpoint_dtype(str(tmp_path)) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert checkpoint_dtype(str(tmp_path)) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert checkpoint_dtype(str(tmp_path)) == "float32"


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_every_model_command_takes_device_dtype_and_device_map(command):
    options = {o for a in _command_parser(build_parser(command), command)._actions for o in a.option_strings}
    assert {"--device", "--dtype", "--device-map"} <= options


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_shows_every_default_and_hides_no_option(command, capsys):
    parser = _command_parser(build_parser(command), command)
    assert all(a.help != "==SUPPRESS==" for a in parser._actions), "no hidden option"
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    formatter = HelpWithDefaults(command)
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, "==SUPPRESS==") and action.nargs != 0:
            shown = formatter._get_help_string(action)
            assert "default" in shown, f"{command} {action.option_strings[0]} shows its default"
    assert "(default: auto)" in text if command in MODEL_COMMANDS else True


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("moe-spec 0.1.0")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_is_cuda_in_the_checkpoints_dtype_on_a_gpu(tiny_folder, capsys):
    summary = _generate(tiny_folder, capsys)
    assert summary["device"] == "cuda" and summary["dtype"] == checkpoint_dtype(str(tiny_folder))
