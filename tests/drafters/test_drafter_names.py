"""One way to name a drafter (`--drafter` on the command line, `drafter=` in the drop-in and the Python
API): lookup, mtp, default, none, or a folder holding an EAGLE-3 head or a causal LM, detected from
its config.json; anything else a clear error listing what is accepted, before anything runs."""

import json

import pytest

from moe_spec.core.target import TargetModel
from moe_spec.drafters.draft_model import DraftModelDrafter
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.drafters.lookup import LookupDrafter
from moe_spec.drafters.mtp import MtpDrafter
from moe_spec.errors import InputError
from moe_spec.loading import drafter_kind, load_drafter, load_target
from moe_spec.testing.helpers import random_eagle_head
from moe_spec.testing.tiny_models import tiny_model, tiny_mtp_checkpoint


def test_each_kind_of_drafter_by_its_name(tmp_path):
    tiny_mtp_checkpoint("deepseek_v3", tmp_path / "target", 1)
    target = TargetModel(load_target(tmp_path / "target"))
    random_eagle_head(target).save_pretrained(tmp_path / "head")
    tiny_model("llama", seed=2, num_hidden_layers=1).save_pretrained(tmp_path / "lm")
    assert load_drafter(None, target) is None and load_drafter("none", target) is None
    assert isinstance(load_drafter("lookup", target), LookupDrafter)
    assert isinstance(load_drafter("mtp", target), MtpDrafter)
    assert drafter_kind(str(tmp_path / "head")) == "eagle"
    assert isinstance(load_drafter(str(tmp_path / "head"), target), EagleDrafter)
    assert drafter_kind(str(tmp_path / "lm")) == "draft_model"
    assert isinstance(load_drafter(str(tmp_path / "lm"), target), DraftModelDrafter)


def test_mtp_on_a_target_without_mtp_layers_is_refused():
    target = TargetModel(tiny_model("qwen3_moe"))
    with pytest.raises(InputError, match="has no MTP layers"):
        load_drafter("mtp", target)


@pytest.mark.parametrize("contents", [None, {"model_type": "not_a_model"}, {"hello": 1}, "not json"])
def test_anything_else_lists_what_is_accepted(tmp_path, contents):
    folder = tmp_path / "thing"
    folder.mkdir()
    if contents is not None:
        (folder / "config.json").write_text(contents if isinstance(contents, str) else json.dumps(contents))
    with pytest.raises(InputError, match="lookup, mtp, default .* a folder holding an EAGLE-3 head or a causal LM"):
        drafter_kind(str(folder))


def test_a_typo_is_not_a_folder():
    with pytest.raises(InputError, match="'lokup': not a folder"):
        drafter_kind("lokup")
