"""`moe-spec demo` on a tiny pair: a random MoE target and a random EAGLE head."""

from __future__ import annotations

import json

import pytest
import torch

from moe_spec.cli import demo as demo_command
from moe_spec.cli.default_method import FALLBACK_METHOD
from moe_spec.cli.main import main
from moe_spec.drafters.eagle_config import config_for_target
from moe_spec.drafters.eagle_head import EagleHead
from moe_spec.core.target import TargetModel
from moe_spec.testing.tiny_models import tiny_model

from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo")
    model = tiny_model("deepseek_v3")
    model.save_pretrained(folder / "model")
    target = TargetModel(model)
    torch.manual_seed(0)
    head = EagleHead(config_for_target(target, draft_vocab_size=64), torch.randperm(target.vocab_size)[:64])
    with torch.no_grad():  # a decisive random head, so trees are not near-uniform
        head.lm_head.weight.normal_(0.0, 0.5)
    head.save_pretrained(folder / "head")
    prompts = folder / "prompts.jsonl"
    lines = [{"class": "code", "prompt_ids": PLAIN_PROMPT}, {"class": "copy", "prompt_ids": REPETITIVE_PROMPT},
             {"class": "copy", "prompt_ids": [9, 8, 7]}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def test_demo_shows_plain_decoding_and_the_default_method_side_by_side(tiny_pair, capsys):
    """Without a profile of this pair the default is the best fixed tree, with the hint on stderr."""
    argv = ["demo", "--model", str(tiny_pair / "model"), "--drafter", "lookup",
            "--prompts", str(tiny_pair / "prompts.jsonl"), "--max-new-tokens", "24"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "continued by plain decoding (ar)" in out and f"continued by {FALLBACK_METHOD} (the default method)" in out
    assert "x plain decoding" in out and "no profile of this target" in captured.err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["command"] == "demo" and summary["default_method"] == FALLBACK_METHOD
    assert summary["prompts"] == ["code", "copy"]  # the first prompt of each class
    assert summary["identical_to_ar"] is True
    assert summary["methods"]["ar"]["speedup_vs_ar"] == 1.0
    assert summary["methods"]["ar"]["mean_accept_len"] == 1.0
    # the copy prompt gets some lookup drafts accepted: the trees were verified, not skipped
    assert summary["methods"][FALLBACK_METHOD]["mean_accept_len"] > 1.0


def test_missing_embedded_pair_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo_command, "DEFAULT_TARGET", tmp_path / "no_target")
    monkeypatch.setattr(demo_command, "DEFAULT_DRAFTER", tmp_path / "no_head")
    assert main(["demo"]) == 2
    err = capsys.readouterr().err
    assert "embedded pair is not in this install" in err and "no_target" in err and "no_head" in err


def test_demo_samples_with_top_k_and_top_p_and_says_so(tiny_pair, capsys):
    argv = ["demo", "--model", str(tiny_pair / "model"), "--drafter", str(tiny_pair / "head"),
            "--prompts", str(tiny_pair / "prompts.jsonl"), "--max-new-tokens", "6",
            "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--seed", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "sampled: temperature=0.7,top_k=5,top_p=0.9" in out and "the same tokens as plain decoding" not in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["sampling"] == "temperature=0.7,top_k=5,top_p=0.9" and summary["identical_to_ar"] is None
