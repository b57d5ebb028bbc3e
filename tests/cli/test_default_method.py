"""`moe-spec generate` without --method decodes with the best method this target and machine allow:
moe-aware where a profile of them exists, else the best fixed tree measured so far with a hint on how
to profile; `moe-spec profile` leaves its profile where generate finds it."""

import json

import pytest

from moe_spec.cli.default_method import FALLBACK_METHOD
from moe_spec.cli.main import main
from moe_spec.testing.helpers import REPETITIVE_PROMPT


@pytest.fixture()
def tiny_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SPEC_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "olmoe"
    assert main(["make-tiny", "--arch", "olmoe", "--out", str(folder)]) == 0
    return folder


def _generate(capsys, *options) -> tuple[dict, str]:
    ids = " ".join(map(str, REPETITIVE_PROMPT))
    assert main(["generate", "--prompt-ids", ids, "--max-new-tokens", "6", "--json", "-", *options]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out.strip().splitlines()[-1]), captured.err


def test_the_embedded_pair_decodes_with_moe_aware_on_its_shipped_profile(capsys):
    summary, err = _generate(capsys)
    assert summary["method"] == "moe-aware" and "no profile" not in err


def test_without_a_profile_the_best_fixed_tree_and_a_hint_then_moe_aware_once_profiled(tiny_folder, tmp_path, capsys):
    summary, err = _generate(capsys, "--model", str(tiny_folder), "--drafter", "lookup")
    assert summary["method"] == FALLBACK_METHOD
    assert "no profile of this target" in err and "moe-spec profile --model" in err
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in (REPETITIVE_PROMPT, [30, 31, 32, 33] * 4)))
    assert main(["profile", "--model", str(tiny_folder), "--drafter", "lookup", "--prompts", str(prompts),
                 "--out", str(tmp_path / "profile.json"), "--max-new-tokens", "8", "--natural-trees", "4",
                 "--grid-tokens", "1,4", "--grid-experts", "2,4", "--batch-sizes", "2", "--repeats", "1",
                 "--warmup", "0", "--evict-mb", "0", "--prefix-len", "16"]) == 0
    assert "profile cached for generate" in capsys.readouterr().err
    summary, err = _generate(capsys, "--model", str(tiny_folder), "--drafter", "lookup")
    assert summary["method"] == "moe-aware" and "no profile" not in err
    assert _generate(capsys, "--model", str(tiny_folder), "--drafter", "none")[0]["method"] == "ar"
