"""`train-draft --kind mtp` and `--kind draft-model`. One MTP layer trained for a target, written into a copy of the target's
checkpoint in the published layout, found there by transformers' loader and `--drafter mtp`, lowering
its loss and decoding losslessly."""

import json

import pytest
import torch
from safetensors import safe_open

from moe_spec import SpecDecoder
from moe_spec.core.target import TargetModel
from moe_spec.drafters.mtp import MtpDrafter
from moe_spec.loading import load_target
from moe_spec.training.train_draft import DraftTrainSettings, TokenData
from moe_spec.training.train_mtp import MTP_META_FILE, train_mtp
from moe_spec.testing.helpers import PLAIN_PROMPT, hf_greedy
from moe_spec.testing.tiny_models import tiny_model

pytestmark = pytest.mark.slow  # trains a layer


def _data() -> TokenData:
    generator = torch.Generator().manual_seed(0)
    return TokenData(torch.randint(3, 96, (3000,), generator=generator), torch.randint(3, 96, (600,), generator=generator))


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_a_trained_mtp_layer_is_found_where_transformers_looks_and_decodes_losslessly(model_type, tmp_path):
    tiny_model(model_type, num_nextn_predict_layers=0).save_pretrained(tmp_path / "target")
    target = TargetModel(load_target(tmp_path / "target"))
    settings = DraftTrainSettings(out=str(tmp_path / "with_mtp"), steps=30, batch_size=4, prompt_len=16,
                                  continuation_len=8, eval_batches=1, warmup_steps=2, lr=3e-3)
    meta = train_mtp(target, tmp_path / "target", _data(), settings)
    saved = json.loads((tmp_path / "with_mtp" / MTP_META_FILE).read_text())
    assert saved["steps"] == meta["steps"] == 30 and len(saved["heldout_top1_agreement_by_depth"]) == 3
    assert saved["final_train_loss_per_pass"][0] < saved["first_train_loss_per_pass"][0]
    config = json.loads((tmp_path / "with_mtp" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    assert not (tmp_path / "target" / "model.safetensors.index.json").exists(), "the source checkpoint is untouched"

    model = load_target(tmp_path / "with_mtp")
    reloaded = TargetModel(model)
    drafter = MtpDrafter.from_target(reloaded)
    n = reloaded.num_layers
    with safe_open(str(tmp_path / "with_mtp" / "model-00002-of-00002.safetensors"), "pt") as f:  # the layer as written
        for stored, loaded in ((f"model.layers.{n}.eh_proj.weight", drafter.mtp.layers[0].eh_proj.weight),
                               (f"model.layers.{n}.shared_head.norm.weight", drafter.mtp.layers[0].post_norm.weight)):
            assert torch.equal(f.get_tensor(stored).float(), loaded.float()), stored
    out = SpecDecoder(reloaded, drafter).generate(torch.tensor([PLAIN_PROMPT]), max_new_tokens=20)
    assert torch.equal(out.sequences, hf_greedy(model, PLAIN_PROMPT, 20))


def test_a_trained_draft_model_loads_by_its_folder_and_decodes_losslessly(tmp_path):
    from moe_spec.loading import drafter_kind, load_drafter
    from moe_spec.training.train_draft_model import train_draft_model

    target = TargetModel(tiny_model("qwen3_moe"))
    settings = DraftTrainSettings(out=str(tmp_path / "draft"), steps=30, batch_size=4, prompt_len=16,
                                  continuation_len=8, eval_batches=1, warmup_steps=2, lr=3e-3)
    meta = train_draft_model(target, tmp_path, _data(), settings, hidden=32, layers=1)
    assert meta["final_train_loss"] < meta["first_train_loss"] and 0.0 <= meta["heldout_top1_agreement"] <= 1.0
    assert drafter_kind(str(tmp_path / "draft")) == "draft_model"
    drafter = load_drafter(str(tmp_path / "draft"), target)
    out = SpecDecoder(target, drafter).generate(torch.tensor([PLAIN_PROMPT]), max_new_tokens=20)
    assert torch.equal(out.sequences, hf_greedy(target.model, PLAIN_PROMPT, 20))
