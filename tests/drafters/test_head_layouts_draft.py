"""One set of random weights written in every published layout drafts the same trees, decodes the same
tokens through `moe-spec generate --drafter FOLDER`, and `convert-head` round-trips byte for byte."""

import json

import pytest
import torch

from moe_spec.cli.main import main
from moe_spec.core.drafting import EAGLE2_BUDGET
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.target import TargetModel
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.drafters.head_layouts import CONFIG_FILE, LAYOUTS, WEIGHTS_FILE, save_head
from moe_spec.testing.helpers import begun_eagle_drafter, random_eagle_head, random_prompt
from moe_spec.testing.tiny_models import tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny target's folder and one random head (bf16, as trained heads ship) in every layout."""
    root = tmp_path_factory.mktemp("layouts")
    model = tiny_model("qwen3_moe")
    model.save_pretrained(root / "target")
    head = random_eagle_head(TargetModel(model), draft_vocab=48)
    for layout in LAYOUTS:
        save_head(head, root / layout, layout)
    return root


def test_every_layout_drafts_the_same_trees(folders):
    target = TargetModel(tiny_model("qwen3_moe"))
    prompt = random_prompt(14, seed=3)
    trees = {}
    for layout in LAYOUTS:
        drafter = EagleDrafter.from_pretrained(folders / layout, target)
        begun = begun_eagle_drafter(target, drafter.head, prompt)
        trees[layout] = begun.propose([int(prompt[-1])], EAGLE2_BUDGET, [EAGLE2_BUDGET.max_depth], SamplingConfig())[0]
    first = trees[LAYOUTS[0]]
    assert first.num_drafted > 10
    for layout, tree in trees.items():
        assert torch.equal(tree.tokens, first.tokens) and torch.equal(tree.parents, first.parents), layout
        assert torch.equal(tree.scores, first.scores), layout


def test_generate_takes_a_head_folder_in_every_layout(folders, capsys):
    outputs = {}
    for layout in LAYOUTS:
        code = main(["generate", "--model", str(folders / "target"), "--prompt-ids", "5 9 17 33 9 17 33 9 17",
                     "--drafter", str(folders / layout), "--method", "eagle2", "--max-new-tokens", "24", "--json", "-"])
        assert code == 0, layout
        outputs[layout] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ar = main(["generate", "--model", str(folders / "target"), "--prompt-ids", "5 9 17 33 9 17 33 9 17",
               "--drafter", str(folders / "eagle"), "--method", "ar", "--max-new-tokens", "24", "--json", "-"])
    assert ar == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for layout, summary in outputs.items():
        assert summary["new_ids"] == plain["new_ids"], layout  # lossless, whichever file the head came from
        assert summary["steps"] == outputs[LAYOUTS[0]]["steps"], layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_convert_head_round_trips_byte_for_byte(folders, tmp_path, layout):
    there, back = tmp_path / layout, tmp_path / "back"
    assert main(["convert-head", str(folders / "speculators"), str(there), "--layout", layout]) == 0
    assert main(["convert-head", str(there), str(back), "--layout", "speculators"]) == 0
    assert (back / WEIGHTS_FILE).read_bytes() == (folders / "speculators" / WEIGHTS_FILE).read_bytes()
    assert json.loads((back / CONFIG_FILE).read_text()) == json.loads((folders / "speculators" / CONFIG_FILE).read_text())


def test_convert_head_refuses_to_overwrite_its_source(folders, capsys):
    assert main(["convert-head", str(folders / "eagle"), str(folders / "eagle"), "--layout", "speculators"]) == 2
    assert "is the source folder" in capsys.readouterr().err
