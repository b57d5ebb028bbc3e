"""The command line, run as a user would (in-process through `main`)."""

import json

import pytest

from moe_spec.cli.main import main

from moe_spec.testing.helpers import REPETITIVE_PROMPT


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "qwen3_moe"
    assert main(["make-tiny", "--arch", "qwen3_moe", "--out", str(folder)]) == 0
    return folder


def test_generate_with_lookup_prints_a_summary_and_a_json_line(tiny_folder, capsys):
    ids = " ".join(map(str, REPETITIVE_PROMPT))
    code = main(["generate", "--model", str(tiny_folder), "--prompt-ids", ids, "--drafter", "lookup", "--max-new-tokens", "20", "--json"])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "mean accepted length" in lines[-2]
    summary = json.loads(lines[-1])
    assert summary["new_tokens"] == len(summary["new_ids"]) <= 20
    assert summary["mean_accept_len"] >= 1.0
    assert summary["unique_experts_per_layer"] > 0


def test_generate_reports_bad_input_as_a_clear_error(tiny_folder, capsys):
    code = main(["generate", "--model", str(tiny_folder), "--prompt", "hello", "--drafter", "lookup"])
    assert code == 2
    assert "has no tokenizer" in capsys.readouterr().err


def test_missing_model_folder_is_a_clear_error(tmp_path, capsys):
    code = main(["generate", "--model", str(tmp_path / "nothing"), "--prompt-ids", "1 2 3", "--drafter", "lookup"])
    assert code == 2
    assert "no model at" in capsys.readouterr().err
