"""The tiny Qwen3-MoE target that vLLM's CPU build runs, for the engine tests
(`tests/vllm/test_vllm_engine.py`) and the engine benchmark's folder (`scripts/vllm_tiny_world.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_spec.testing.tiny_models import tiny_model

# 4 layers, head_dim 32 (the smallest vLLM's CPU attention takes), 8 experts of which 2 a token
TARGET_SHAPE = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=512,
                    max_position_embeddings=512)


def predictable_target(cycle: int = 6, seed: int = 0):
    """A tiny Qwen3-MoE whose greedy text follows short cycles of tokens, so drafters have something
    to get right: each token's embedding is the output row of the token after it in its cycle, and
    the layers (attention, router, experts: all run) add small perturbations to that."""
    generator = torch.Generator().manual_seed(seed)
    model = tiny_model("qwen3_moe", seed=seed, **TARGET_SHAPE)
    vocab = TARGET_SHAPE["vocab_size"]
    order = torch.randperm(vocab, generator=generator)
    following = torch.empty(vocab, dtype=torch.long)
    for start in range(0, vocab, cycle):
        members = order[start: start + cycle]
        following[members] = members.roll(-1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
        embedding = model.get_input_embeddings().weight
        embedding.copy_(torch.randn(embedding.shape, generator=generator))
        model.lm_head.weight[following] = embedding.clone()
    return model


def repeating_prompts(count: int, seed: int) -> list[torch.Tensor]:
    """Prompts with repeats in them (so lookup has something to find), ids in the tiny vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        motif = torch.randint(3, 500, (int(torch.randint(3, 7, (1,), generator=generator)),), generator=generator)
        noise = torch.randint(3, 500, (6,), generator=generator)
        out.append(torch.cat([noise, motif, motif, motif[:2]]))
    return out


def build_world(out, vllm_python, prompts: int = 6, max_k: int = 3, max_batch: int = 8, new_tokens: int = 24,
                engine_max_k: int = 2, engine_batch_sizes: str = "1,6") -> dict:
    """On disk under `out`: the target (`target/`), an EAGLE-3 head trained for it by `train_draft`
    for 60 steps (`head/`), `prompts.jsonl`, a profile of the pair (`profile.json`) and three
    exports: the head with the profile-priced schedule (`export/`), with a schedule priced by vLLM's
    own step times (`export_engine/`: one engine per K up to `engine_max_k`, run by `vllm_python`),
    and the lookup drafter with moe_spec's proposer (`export_lookup/`). Returns the model, the
    `TargetModel` and the prompts."""
    from moe_spec.cli.main import main
    from moe_spec.core.target import TargetModel
    from moe_spec.training.train_draft import DraftTrainSettings, TokenData, train_draft

    out = Path(out)
    model = predictable_target()
    model.save_pretrained(out / "target")
    target = TargetModel(model)
    stream = torch.cat(repeating_prompts(200, seed=1))
    train_draft(target, TokenData(stream[:-300], stream[-300:]),
                DraftTrainSettings(out=str(out / "head"), steps=60, batch_size=8, prompt_len=24, continuation_len=16,
                                   draft_vocab=256, eval_batches=1, vocab_batches=2, lr=3e-3))
    prompt_ids = repeating_prompts(prompts, seed=2)
    prompt_file = out / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt_ids": p.tolist()}) + "\n" for p in prompt_ids))
    model_args = ["--model", str(out / "target")]
    _cli(main, ["profile", *model_args, "--drafter", str(out / "head"), "--prompts", str(prompt_file), "--out",
                str(out / "profile.json"), "--max-new-tokens", "16", "--repeats", "1", "--grid-tokens", "1,4,16",
                "--grid-experts", "2,8", "--natural-trees", "4", "--batch-sizes", "2", "--prefix-len", "16"])
    export = [*model_args, "--profile", str(out / "profile.json"), "--prompts", str(prompt_file), "--max-batch",
              str(max_batch), "--max-new-tokens", str(new_tokens)]
    for drafter, folder in ((str(out / "head"), "export"), ("lookup", "export_lookup")):
        _cli(main, ["export-vllm", *export, "--drafter", drafter, "--max-k", str(max_k), "--out", str(out / folder)])
    _cli(main, ["export-vllm", *export, "--drafter", str(out / "head"), "--max-k", str(engine_max_k), "--out",
                str(out / "export_engine"), "--engine-costs", "measure", "--engine-batch-sizes", engine_batch_sizes,
                "--vllm-python", str(vllm_python)])
    return {"model": model, "target": target, "prompts": prompt_ids}


def _cli(main, argv: list[str]) -> None:
    if main(argv) != 0:
        raise RuntimeError(f"`moe-spec {' '.join(argv)}` failed")
