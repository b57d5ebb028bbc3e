"""Training a draft head by self-distillation, on tiny random targets of several architectures."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.drafters.eagle_config import config_for_target
from moe_spec.drafters.eagle_head import EagleHead
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.target import TargetModel
from moe_spec.testing.tiny_models import tiny_model
from moe_spec.cli import train_draft as train_draft_command
from moe_spec.training import train_draft
from moe_spec.training.train_draft import DistillLoss, DraftTrainSettings, TokenData, draft_vocabulary

pytestmark = pytest.mark.slow  # trains heads

torch.set_num_threads(1)


def _data(seed: int = 0) -> TokenData:
    generator = torch.Generator().manual_seed(seed)
    return TokenData(torch.randint(3, 96, (3000,), generator=generator), torch.randint(3, 96, (600,), generator=generator))


def _settings(out, **overrides) -> DraftTrainSettings:
    small = dict(steps=4, batch_size=4, prompt_len=16, continuation_len=8, draft_vocab=64, vocab_batches=1,
                 eval_batches=1, warmup_steps=2, lr=3e-3)
    return DraftTrainSettings(out=str(out), **{**small, **overrides})


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_trained_head_reloads_and_decodes_like_generate(model_type, tmp_path):
    model = tiny_model(model_type)
    target = TargetModel(model)
    meta = train_draft.train_draft(target, _data(), _settings(tmp_path))
    saved = json.loads((tmp_path / train_draft.META_FILE).read_text())
    assert saved["steps"] == meta["steps"] == 4
    assert len(saved["heldout_top1_agreement_by_depth"]) == 3
    assert 0.0 < saved["heldout_token_coverage"] <= 1.0
    assert saved["target"]["model_type"] == model_type

    drafter = EagleDrafter.from_pretrained(tmp_path, target)
    assert drafter.head.config.draft_vocab_size == 64
    prompt = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(5))
    out = SpecDecoder(target, drafter=drafter).generate(prompt, max_new_tokens=24, eos_token_id=[])
    reference = model.generate(prompt, do_sample=False, max_new_tokens=24, min_new_tokens=24, eos_token_id=[],
                               pad_token_id=0)
    assert torch.equal(out.sequences, reference)


def test_a_deeper_head_trains_saves_its_layers_and_decodes_losslessly(tmp_path):
    """`head_layers` 2: the second layer is a plain decoder layer of the head's width, written as
    speculators' `layers.1.*` and read back with both layers' trained weights."""
    model = tiny_model("deepseek_v3")
    target = TargetModel(model)
    train_draft.train_draft(target, _data(), _settings(tmp_path, steps=3, head_layers=2))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    head = EagleHead.from_pretrained(tmp_path)
    assert head.config.num_layers == 2 and len(head.layers) == 2
    assert head.layers[1].self_attn.q_proj.in_features == head.config.hidden_size  # only layer 0 reads 2H
    drafter = EagleDrafter.from_pretrained(tmp_path, target)
    prompt = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(6))
    out = SpecDecoder(target, drafter=drafter).generate(prompt, max_new_tokens=20, eos_token_id=[])
    reference = model.generate(prompt, do_sample=False, max_new_tokens=20, min_new_tokens=20, eos_token_id=[],
                               pad_token_id=0)
    assert torch.equal(out.sequences, reference)
    with pytest.raises(ValueError, match="head_layers"):
        DraftTrainSettings(out=str(tmp_path), head_layers=0)
    for other in (1, 3):  # 1 too: asked for by name, not the fresh head's default
        with pytest.raises(ValueError, match=f"head_layers {other}: .* has 2"):
            train_draft.train_draft(target, _data(), _settings(tmp_path / "x", steps=1, init=str(tmp_path),
                                                               head_layers=other))


def test_training_lowers_the_distillation_loss(tmp_path):
    target = TargetModel(tiny_model("qwen3_moe"))
    meta = train_draft.train_draft(target, _data(), _settings(tmp_path, steps=40))
    first, final = meta["first_train_loss_per_pass"], meta["final_train_loss_per_pass"]
    assert all(f < s - 0.1 for f, s in zip(final, first)), (first, final)


def test_same_seed_same_head(tmp_path):
    target = TargetModel(tiny_model("qwen3_moe"))
    for run in ("a", "b"):
        train_draft.train_draft(target, _data(), _settings(tmp_path / run, steps=3))
    a, b = EagleHead.from_pretrained(tmp_path / "a"), EagleHead.from_pretrained(tmp_path / "b")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_draft_vocabulary_ranks_corpus_and_generated_frequencies_equally():
    corpus = torch.tensor([0, 50, 30, 20, 0])  # shares of ids 1, 2, 3: 0.5, 0.3, 0.2
    generated = torch.tensor([0, 0, 0, 1, 1])  # shares of ids 3, 4: 0.5, 0.5
    # totals 0.5, 0.3, 0.7, 0.5: id 3 first, then the tie 1 / 4 toward the lower id
    assert draft_vocabulary(corpus, generated, 3).tolist() == [3, 1, 4]


def test_loss_is_the_restricted_target_distribution_and_skips_uncovered_positions():
    target = TargetModel(tiny_model("qwen3_moe"))
    d2t = torch.arange(8)
    head = EagleHead(config_for_target(target, draft_vocab_size=8), d2t)
    loss_fn = DistillLoss(head, ttt_steps=1, ttt_decay=1.0)
    features = torch.randn(1, 5, len(target.feature_layers), 32)
    embeds = torch.randn(1, 5, 32)
    logits = torch.randn(1, 5, 96)
    logits[0, 1:, 50] = 100.0  # the target's argmax is outside the draft vocabulary everywhere ...
    logits[0, 2, 3] = 200.0  # ... except at row 2 (pair 1), where it is draft token 3
    loss, per_pass, _ = loss_fn(features, embeds, logits)
    logq = torch.log_softmax(head.logits(head.unroll(features, embeds, 1)[0])[0, 1], -1)
    p = logits[0, 2, :8].softmax(-1)
    assert torch.allclose(loss, -(p * logq).sum(), atol=1e-5)


def test_command_line_arguments_default_to_the_settings():
    parser = argparse.ArgumentParser()
    train_draft_command.add_arguments(parser)
    args = parser.parse_args(["--target", "t", "--out", "o", "--steps", "7", "--draft-vocab", "512", "--prompts", "a.py", "b.py"])
    assert (args.steps, args.draft_vocab, args.prompts, args.seed) == (7, 512, ["a.py", "b.py"], 0)
    defaults = DraftTrainSettings(out="o", steps=7, draft_vocab=512)
    assert train_draft_command.settings_from_args(args) == defaults
    data_args = parser.parse_args(["--target", "t", "--out", "o", "--prompt-len", "64", "--continuation-len", "48",
                                   "--sampled-share", "0.25", "--random-prompt-share", "0.125",
                                   "--repeat-prompt-share", "0.25"])
    assert train_draft_command.settings_from_args(data_args) == DraftTrainSettings(
        out="o", prompt_len=64, continuation_len=48, sampled_share=0.25, random_prompt_share=0.125,
        repeat_prompt_share=0.25)


def test_random_prompt_rows_start_from_the_texts_tokens_in_no_order_the_text_has():
    target = TargetModel(tiny_model("qwen3_moe"))
    data = _data()
    settings = _settings("unused", batch_size=4, prompt_len=24, continuation_len=3, random_prompt_share=0.5)
    batches = train_draft._Batches(target, data.train, settings, process=0)
    rows = batches(step=5)  # [4, 27]
    assert rows.shape == (4, 27) and torch.equal(rows, batches(step=5))  # a pure function of the step
    stream = data.train.tolist()
    is_window = [any(stream[i : i + 24] == row[:24] for i in range(len(stream) - 24)) for row in rows.tolist()]
    assert is_window == [True, True, False, False]  # the last half start from random tokens
    assert set(rows[2:, :24].flatten().tolist()) <= set(data.train.tolist())
    assert len(set(rows[2:, :24].flatten().tolist())) > 20  # drawn across the vocabulary, not one token
    plain = train_draft._Batches(target, data.train, _settings("unused", batch_size=4, prompt_len=24,
                                                                continuation_len=3), process=0)
    assert torch.equal(plain(step=5)[:2, :24], rows[:2, :24])  # the text rows start alike with or without


def test_repeat_rows_follow_their_window_with_its_own_start_and_leave_the_other_rows_alone():
    target = TargetModel(tiny_model("qwen3_moe"))
    data = _data()
    settings = _settings("unused", batch_size=4, prompt_len=24, continuation_len=3, random_prompt_share=0.25,
                         repeat_prompt_share=0.5)
    rows = train_draft._Batches(target, data.train, settings, process=0)(step=5)  # [4, 27]
    plain = train_draft._Batches(target, data.train, _settings("unused", batch_size=4, prompt_len=24,
                                                                continuation_len=3), process=0)(step=5)
    assert torch.equal(rows[0, :24], plain[0, :24]), "row 0 is text"
    for b in (1, 2):  # the rows before the random one repeat
        assert torch.equal(rows[b, :18], plain[b, :18]) and torch.equal(rows[b, 18:24], plain[b, :6])
    stream = data.train.tolist()
    assert not any(stream[i : i + 24] == rows[3, :24].tolist() for i in range(len(stream) - 24)), "row 3 is random"


def test_a_share_outside_zero_to_one_is_refused_naming_it():
    with pytest.raises(ValueError, match="random_prompt_share must be in"):
        DraftTrainSettings(out="o", random_prompt_share=1.5)
    with pytest.raises(ValueError, match="repeat_prompt_share must be in"):
        DraftTrainSettings(out="o", repeat_prompt_share=-0.5)
    with pytest.raises(ValueError, match="random_prompt_share \\+ repeat_prompt_share must be at most 1"):
        DraftTrainSettings(out="o", random_prompt_share=0.5, repeat_prompt_share=0.75)


def test_training_leaves_the_callers_global_rng_and_threads_alone(tmp_path):
    target = TargetModel(tiny_model("qwen3_moe"))
    torch.manual_seed(123)
    before = torch.get_rng_state()
    threads = torch.get_num_threads()
    train_draft.train_draft(target, _data(), _settings(tmp_path, steps=1))
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.get_num_threads() == threads


def test_training_further_starts_from_a_head_in_any_layout_and_keeps_its_vocabulary(tmp_path):
    from moe_spec.drafters.head_layouts import load_head, save_head

    target = TargetModel(tiny_model("qwen3_moe"))
    fresh = train_draft.train_draft(target, _data(), _settings(tmp_path / "fresh", steps=40))
    save_head(load_head(tmp_path / "fresh"), tmp_path / "eagle", "eagle", dtype=torch.float32)
    further = train_draft.train_draft(target, _data(1), _settings(tmp_path / "further", steps=2, init=str(tmp_path / "eagle")))
    # its first step is the trained head's, well below a fresh head's first step
    assert all(a < b - 0.1 for a, b in zip(further["first_train_loss_per_pass"], fresh["first_train_loss_per_pass"]))
    start, end = load_head(tmp_path / "fresh"), load_head(tmp_path / "further")
    assert torch.equal(start.draft_to_target, end.draft_to_target)
    assert start.config.aux_layers == end.config.aux_layers
    assert not torch.equal(start.fc.weight, end.fc.weight)
    assert further["init"]["path"] == str(tmp_path / "eagle") and further["init"]["meta"] is None  # convert-head writes none


def test_training_further_refuses_other_feature_layers_and_other_kinds(tmp_path):
    target = TargetModel(tiny_model("qwen3_moe"))
    train_draft.train_draft(target, _data(), _settings(tmp_path / "head", steps=1))
    with pytest.raises(ValueError, match="aux_layers .*fuses"):
        train_draft.train_draft(target, _data(), _settings(tmp_path / "x", steps=1, init=str(tmp_path / "head"),
                                                           aux_layers=(0, 1)))
    parser = argparse.ArgumentParser()
    train_draft_command.add_arguments(parser)
    from moe_spec.errors import InputError

    with pytest.raises(InputError, match="--init"):
        train_draft_command.run(parser.parse_args(["--kind", "mtp", "--target", "t", "--out", "o",
                                                   "--init", str(tmp_path / "head")]))
