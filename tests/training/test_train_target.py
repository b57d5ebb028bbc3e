"""The default-target training pipeline, run end to end on a tiny shape."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from moe_spec.cli import train_target as train_target_command
from moe_spec.training import train_target
from moe_spec.training.corpus import heldout_prompts, is_excluded, is_heldout, load_corpus

pytestmark = pytest.mark.slow  # trains targets


def _train(out, *extra: str) -> dict:
    parser = argparse.ArgumentParser()
    train_target_command.add_arguments(parser)
    return train_target_command.run(parser.parse_args(["--out", str(out), "--tiny", *extra]))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    meta = _train(out, "--max-steps", "6")
    return out, meta


def test_corpus_excludes_tests_and_splits_by_file():
    assert is_excluded("test/test_os.py") and is_excluded("idlelib/idle_test/htest.py")
    assert is_excluded("lib2to3/tests/data/foo.py") and is_excluded("json/test_x.py")
    assert not is_excluded("json/decoder.py") and not is_excluded("unittest/case.py")
    corpus = load_corpus()
    train_paths = {f.path for f in corpus.train_files}
    heldout_paths = [f.path for f in corpus.heldout_files]
    assert heldout_paths and not train_paths & set(heldout_paths)
    assert all(is_heldout(p) for p in heldout_paths)
    assert heldout_paths == sorted(heldout_paths)


def test_heldout_prompts_are_deterministic_line_starts():
    corpus = load_corpus()
    prompts = heldout_prompts(5, 300, seed=1)
    assert prompts == heldout_prompts(5, 300, seed=1) != heldout_prompts(5, 300, seed=2)
    texts = [f.text for f in corpus.heldout_files]
    for prompt in prompts:
        assert len(prompt) == 300
        assert any(text.startswith(prompt) or ("\n" + prompt) in text for text in texts)


def test_refine_biases_evens_out_a_skewed_router():
    config = DeepseekV3Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1)
    router = DeepseekV3TopkRouter(config)
    generator = torch.Generator().manual_seed(0)
    router.weight.data = 0.3 * torch.randn(8, 16, generator=generator)
    router.weight.data[0] += 0.3  # with inputs of positive mean, expert 0 wins often
    hidden = torch.randn(4096, 16, generator=generator) + 0.5  # [B*T, D]

    def spread():
        load = torch.bincount(router(hidden)[2].flatten(), minlength=8)
        return train_target.load_spread(load[None])[0]

    before = spread()
    for _ in range(30):
        train_target.refine_biases([router], [hidden], gamma=0.01, refinements=3, clip=1.0)
    after = spread()
    assert before[1] > 2.5
    assert 0.9 < after[0] and after[1] < 1.1


def test_tiny_run_saves_a_model_that_reloads(finished_run):
    out, meta = finished_run
    model_dir = out / "model"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert model.dtype == torch.bfloat16
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    ids = tokenizer("def f(x):\n    return x\n", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)

    state = json.loads((out / "checkpoint" / "state.json").read_text())
    trained = {k.removeprefix("model."): v for k, v in load_file(out / "checkpoint" / state["weights"]).items()}
    for i, layer in enumerate(model.model.layers):
        bias = layer.mlp.gate.e_score_correction_bias
        assert bias.dtype == torch.float32
        assert torch.equal(bias, trained[f"model.layers.{i}.mlp.gate.e_score_correction_bias"])
        assert bias.abs().sum() > 0  # balancing moved it

    assert meta["steps"] == 6 and meta["bias_restored_by_from_pretrained"]
    assert meta["corpus_sha256"] == load_corpus().sha256
    assert abs(meta["heldout_fp32"]["loss"] - meta["heldout_bf16_weights"]["loss"]) < 0.05
    assert json.loads((model_dir / "moe_spec_meta.json").read_text())["tokens_seen"] == meta["tokens_seen"]


def test_resume_continues_from_the_checkpoint_step(tmp_path, finished_run):
    assert _train(tmp_path, "--max-steps", "6", "--stop-after-steps", "3") == {"stopped_at_step": 3}
    assert not (tmp_path / "model").exists()
    meta = _train(tmp_path, "--max-steps", "6")

    events = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    resumes = [e for e in events if e.get("event") == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 3
    assert meta["steps"] == 6
    # An interrupted run ends where the uninterrupted one does.
    reference = load_file(finished_run[0] / "model" / "model.safetensors")
    resumed = load_file(tmp_path / "model" / "model.safetensors")
    assert reference.keys() == resumed.keys()
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)


def test_training_leaves_the_callers_global_rng_alone(tmp_path):
    settings = train_target_command.settings_from_args(argparse.Namespace(
        out=str(tmp_path), minutes=1.0, seed=0, max_steps=2, stop_after_steps=None, checkpoint_every_s=300.0,
        tiny=True))
    torch.manual_seed(123)
    before = torch.get_rng_state()
    threads = torch.get_num_threads()
    train_target.train(settings)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.get_num_threads() == threads
