"""Golden EAGLE-3 fixtures from the reference implementation (vllm-project/speculators 0.9.0).

Builds a few small random speculators-format EAGLE-3 draft heads with a fixed seed, saves each with
speculators' own `save_pretrained` and records, computed by speculators' own `Eagle3DraftModel.forward`,
the draft logits of its first pass and of its second training-time-test (TTT) step. moe_spec's
EAGLE-3 loader and forward are checked against these files; nothing in moe_spec imports speculators.

Output, per variant, under tests/fixtures/eagle3_golden/<variant>/:
    head/config.json, head/model.safetensors   as speculators writes them (the copy of its config.py
                                               source that transformers adds is deleted)
    io.safetensors                             inputs, logits of both steps, step-2 feeding (float32)
    meta.json                                  flags, shapes, the pairing and feeding conventions

This runs only in its own venv (speculators pins transformers<=5.19 and pulls training deps, so it
is kept out of moe_spec's). Its EAGLE-3 code runs under transformers 5.23 all the same:

    python3 -m venv /work/venvs/speculators
    P=/work/venvs/speculators/bin/pip
    $P install torch==2.13.0            # the same torch as .venv; never an unpinned torch
    $P install transformers==5.23.0     # the same transformers as .venv
    $P install --no-deps speculators==0.9.0
    $P install openai "datasets==5.1.0" "hs-connectors==0.9.0" "loguru==0.7.3"  # what its eagle3 code imports
    /work/venvs/speculators/bin/python scripts/make_eagle3_golden.py [--out DIR] [--extra]

`--extra` also writes two more variants (`norm_before_fc`, `qwen3_qk_norm`) that are left out by
default to keep the committed fixtures small. The run is deterministic: run it twice and the bytes
are the same. Attention is `eager`: speculators' default (flex attention) fails on short unpadded
inputs on the CPU, and its dense masks are bfloat16, which SDPA rejects next to float32 queries.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; no hub look-ups

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "eagle3_golden"

T = 12  # tokens per fixture
HIDDEN = 64  # head hidden size H
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
INTERMEDIATE = 128
VOCAB = 512  # target vocabulary V
DRAFT_VOCAB = 128  # draft vocabulary Vd
AUX_IDS = [1, 5, 9]  # speculators/vLLM convention: id i = input of target layer i = HF hidden_states[i]

# name -> (seed, overrides). Keys: layers, target_hidden, model_type, aux_ids, and the config flags
# norm_before_residual / norm_before_fc / fc_norm / norm_output.
VARIANTS: dict[str, tuple[int, dict]] = {
    "default": (1001, {"aux_ids": None}),
    "norm_before_residual": (1002, {"norm_before_residual": True}),
    "target_hidden_96": (1003, {"target_hidden": 96}),
    "two_layers": (1004, {"layers": 2}),
    "eagle31_fc_norm_norm_output": (1005, {"fc_norm": True, "norm_output": True}),
}
EXTRA_VARIANTS: dict[str, tuple[int, dict]] = {
    "norm_before_fc": (1006, {"norm_before_fc": True}),
    "qwen3_qk_norm": (1007, {"model_type": "qwen3"}),
}
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def layer_config(model_type: str, layers: int):
    """The `transformer_layer_config` of the head: a llama (or qwen3) decoder layer config."""
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
                  max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False)
    if model_type == "qwen3":
        from transformers import Qwen3Config
        config = Qwen3Config(**common)
    else:
        from transformers import LlamaConfig
        config = LlamaConfig(**common)
    config._attn_implementation = "eager"
    return config


def build(seed: int, spec: dict):
    """A speculators Eagle3DraftModel with every weight random (seeded) and a random sorted d2t/t2d."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    torch.manual_seed(seed)
    model_type = spec.get("model_type", "llama")
    target_hidden = spec.get("target_hidden")
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config(model_type, spec.get("layers", 1)),
        draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=target_hidden,
        eagle_aux_hidden_state_layer_ids=spec.get("aux_ids", AUX_IDS),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=[
                "Qwen3ForCausalLM" if model_type == "qwen3" else "LlamaForCausalLM"]),
        ),
        **{flag: spec[flag] for flag in FLAGS if flag in spec},
    )
    model = Eagle3DraftModel(config)
    if target_hidden is not None:
        # speculators 0.9.0's Eagle3DraftModel sizes fc from the head's own hidden size and ignores
        # target_hidden_size (its legacy converter model, vLLM, SpecForge and EAGLE all size it
        # 3*target_hidden_size). Swap in the fc those readers expect; the forward only calls self.fc.
        model.fc = torch.nn.Linear(3 * target_hidden, HIDDEN, bias=False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("verifier_"):  # not saved, not used without a loss
                param.copy_(torch.ones_like(param) if param.dim() == 1 else torch.zeros_like(param))
            elif param.dim() == 1:  # every RMSNorm weight (hidden_norm, q/k norms, fc_norm, ...)
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name == "embed_tokens.weight":
                param.copy_(torch.randn_like(param))
            else:  # Linear [out, in]
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
        kept = torch.sort(torch.randperm(VOCAB)[:DRAFT_VOCAB]).values
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[kept] = True
        d2t = kept - torch.arange(DRAFT_VOCAB)  # target id = draft id + d2t[draft id]
    model.load_vocab_mappings(t2d, d2t)
    return model.eval()


def run(model, hidden_states, input_ids, position_ids, ttt_steps=2):
    """speculators' own forward, with hooks recording what it computes: per TTT step the logits
    (lm_head outputs), the last decoder layer's output, and the hidden each step feeds to layer 0."""
    logits, layer_out, layer0_in = [], [], []
    hooks = [
        model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out.detach().clone())),
        model.layers[-1].register_forward_hook(lambda _m, _i, out: layer_out.append(out.detach().clone())),
        model.layers[0].register_forward_pre_hook(lambda _m, args: layer0_in.append(args[0].detach().clone())),
    ]
    try:
        with torch.no_grad():
            drafts = model(hidden_states=hidden_states, input_ids=input_ids,
                           document_ids=torch.zeros_like(input_ids), position_ids=position_ids, ttt_steps=ttt_steps)
    finally:
        for hook in hooks:
            hook.remove()
    for step, (tokens, step_logits) in enumerate(zip(drafts, logits)):
        assert torch.equal(tokens, step_logits.argmax(-1)), f"step {step}: hooked logits are not the forward's"
    return logits, layer_out, layer0_in


def meta_for(name: str, seed: int, spec: dict, model, extras: dict) -> dict:
    from importlib.metadata import version
    import transformers

    cfg = model.config
    target_hidden = spec.get("target_hidden") or HIDDEN
    return {
        "variant": name,
        "seed": seed,
        "generated_by": "scripts/make_eagle3_golden.py",
        "versions": {"speculators": version("speculators"), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "config_flags": {
            "transformer_layer_config.model_type": cfg.transformer_layer_config.model_type,
            "num_hidden_layers": cfg.transformer_layer_config.num_hidden_layers,
            "hidden_size": HIDDEN, "target_hidden_size": spec.get("target_hidden"),
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
            "intermediate_size": INTERMEDIATE, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
            "eagle_aux_hidden_state_layer_ids": cfg.eagle_aux_hidden_state_layer_ids,
            **{flag: getattr(cfg, flag) for flag in FLAGS},
        },
        "dtype": "float32",
        "attention_implementation": "eager (speculators' dense additive mask path, create_float_mask)",
        "io_tensors": {
            "input_ids": f"int64 [1, {T}]: ids of step 1",
            "hidden_states": f"float32 [1, {T}, {3 * target_hidden}]: concatenated aux hidden states "
                             "(aux 0 | aux 1 | aux 2, each Ht wide), N(0,1)",
            "position_ids": f"int64 [1, {T}]: positions of step 1 = 0..{T - 1}",
            "logits": f"float32 [1, {T}, {DRAFT_VOCAB}]: step 1 (first, non-TTT pass) draft-vocab logits",
            "hidden_out": f"float32 [1, {T}, {HIDDEN}]: step 1 output of the last decoder layer, before the "
                          "final norm",
            "input_ids_ttt1": f"int64 [1, {T}]: ids of step 2 = input_ids shifted left by one, 0 appended",
            "hidden_ttt1_in": f"float32 [1, {T}, {HIDDEN}]: the hidden step 2 feeds layer 0 in place of "
                              "fc(aux): hidden_out, or norm(hidden_out) when norm_output",
            "position_ids_ttt1": f"int64 [1, {T}]: positions of step 2 = position_ids + 1",
            "logits_ttt1": f"float32 [1, {T}, {DRAFT_VOCAB}]: step 2 (TTT step 1) draft-vocab logits",
        },
        "pairing": (
            "Row t of input_ids pairs with row t of hidden_states: speculators' forward consumes ids and "
            "aux hidden at the same index (its data loader, speculators.models.eagle3.data.shift_batch, "
            "has already dropped the first id and the last hidden). In sequence terms: with target "
            "tokens x_0..x_T and the target's aux hidden states g_0..g_T (g_s computed at x_s), "
            "input_ids[t] = x_{t+1} and hidden_states[t] = g_t; logits[t] is the draft's guess for "
            "x_{t+2}, i.e. the token after input_ids[t]. Step 1 attention is causal over rows 0..t, "
            "one document (document_ids all 0, no padding)."
        ),
        "positions": (
            f"Step 1 uses position_ids 0..{T - 1}, passed explicitly (speculators' forward defaults to "
            f"1..{T}, the positions shift_batch leaves). RoPE is relative, so the logits do not depend on the "
            "offset: max |logits(1..T) - logits(0..T-1)| = "
            f"{extras['offset_diff']:.3g}, max |logits_ttt1(...)| diff = {extras['offset_diff_ttt1']:.3g}."
        ),
        "step1_math": (
            "a = hidden_states; if norm_before_fc: a = input_norm(a); if fc_norm: a = concat(fc_norm[k](a_k)); "
            "h = fc(a); e = embed_tokens(input_ids); layer 0: r = h (or hidden_norm(h) if "
            "norm_before_residual); x = concat(input_layernorm(e), hidden_norm(h)) -> self_attn (q/k/v take 2H) "
            "-> r + attn; then the usual post_attention_layernorm + MLP residual block; layers 1.. are plain "
            "decoder layers on H. logits = lm_head(norm(last layer output))."
        ),
        "ttt_step2_feeding": (
            "Step 2 (speculators' TTT step 1, logits_ttt1): ids = input_ids_ttt1 (input_ids shifted left "
            "by one, 0 appended; teacher forcing: row t gets x_{t+2}, the token step 1 row t should have "
            "predicted); hidden fed to layer 0 = hidden_ttt1_in (row t = step 1's last-layer output at row t, "
            "pre-norm, or after the final norm when norm_output; it does NOT go through fc/fc_norm/input_norm) "
            "and layer 0 applies hidden_norm to it as in step 1; positions = position_ids + 1. Attention in "
            "every layer: the step-1 keys/values of that layer stay in the cache (computed at step-1 positions), "
            "and the step-2 query at row t attends to the step-1 keys of rows 0..t plus its own step-2 key at "
            "row t only (speculators' extend_dense_mask_for_draft_tokens). That is a depth-2 tree node under "
            "row t: prefix 0..t, then itself. logits_ttt1[t] guesses x_{t+3}. The last row's step-2 id is the "
            "pad 0, still computed and recorded."
        ),
        "d2t_t2d": (
            "head/model.safetensors holds d2t int64 [Vd] and t2d bool [V]: target id = draft id + "
            "d2t[draft id]; t2d[target id] is True exactly for the Vd target ids kept (sorted ascending, "
            "so draft id i is the i-th True of t2d)."
        ),
        "reload_check": extras["reload"],
        "notes": extras["notes"],
    }


def write_variant(out: Path, name: str, seed: int, spec: dict) -> dict:
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    model = build(seed, spec)
    target_hidden = spec.get("target_hidden") or HIDDEN
    gen = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(0, VOCAB, (1, T), generator=gen)
    hidden_states = torch.randn(1, T, 3 * target_hidden, generator=gen)
    position_ids = torch.arange(T).unsqueeze(0)

    logits, layer_out, layer0_in = run(model, hidden_states, input_ids, position_ids)
    shifted, _, _ = run(model, hidden_states, input_ids, position_ids + 1)
    extras = {"offset_diff": (shifted[0] - logits[0]).abs().max().item(),
              "offset_diff_ttt1": (shifted[1] - logits[1]).abs().max().item(), "notes": []}

    hidden_ttt1_in = layer0_in[1][..., HIDDEN:]  # layer 0 gets concat(embeds, hidden)
    expected_in = model.norm(layer_out[0]) if model.config.norm_output else layer_out[0]
    assert torch.equal(hidden_ttt1_in, expected_in), "step 2 was not fed what meta.json says"
    assert torch.equal(layer0_in[1][..., :HIDDEN], model.embed_tokens(torch.cat(
        [input_ids[:, 1:], input_ids.new_zeros(1, 1)], dim=-1))), "step 2 ids are not what meta.json says"

    variant_dir = out / name
    if variant_dir.exists():
        shutil.rmtree(variant_dir)
    head_dir = variant_dir / "head"
    model.save_pretrained(head_dir)  # speculators' own writer: config.json + model.safetensors
    # transformers also drops a copy of speculators' config.py there (config.json's auto_map names it
    # as remote code). It is third-party source, not data, and nothing may import it: not kept.
    (head_dir / "config.py").unlink(missing_ok=True)
    extras["notes"].append(
        "speculators' save_pretrained also writes head/config.py (a copy of its Eagle3SpeculatorConfig "
        "source, which config.json's auto_map points at); it is deleted. config.json's architectures is "
        "['Eagle3DraftModel'] (the class that saved it); speculators_model_type 'eagle3' is the identifier.")

    if spec.get("target_hidden") is None:
        config = Eagle3SpeculatorConfig.from_pretrained(head_dir)
        config.transformer_layer_config._attn_implementation = "eager"
        # There is no verifier to pull embeddings / lm_head from (verifier.name_or_path is null, the
        # head carries its own); Eagle3DraftModel.load_verifier_weights would still look the null
        # name up on the hub, so it is skipped for the reload.
        load_verifier_weights = Eagle3DraftModel.load_verifier_weights
        Eagle3DraftModel.load_verifier_weights = lambda self: None
        try:
            reloaded = Eagle3DraftModel.from_pretrained(head_dir, config=config).eval()
        finally:
            Eagle3DraftModel.load_verifier_weights = load_verifier_weights
        again, _, _ = run(reloaded, hidden_states, input_ids, position_ids)
        same = torch.equal(again[0], logits[0]) and torch.equal(again[1], logits[1])
        assert same, "speculators' from_pretrained of the saved head gives other logits"
        extras["reload"] = "Eagle3DraftModel.from_pretrained(head/) reproduces logits and logits_ttt1 bit for bit"
    else:
        extras["reload"] = ("not reloadable by speculators 0.9.0: its Eagle3DraftModel builds fc as "
                            "[H, 3*H] and ignores target_hidden_size, so from_pretrained hits a shape mismatch "
                            f"on fc.weight [{HIDDEN}, {3 * target_hidden}]")
        extras["notes"].append(
            "fc was replaced after construction by Linear(3*target_hidden_size, H) (speculators 0.9.0's "
            "Eagle3DraftModel ignores target_hidden_size); everything else, the forward included, is "
            "speculators' own. The saved layout (config target_hidden_size=96, fc.weight [64, 288]) is the "
            "one vLLM's Eagle3LlamaForCausalLM, SpecForge and EAGLE read.")
    if model.config.norm_output:
        extras["notes"].append("norm_output only changes what step 2 is fed (post-norm hidden); step 1 logits "
                               "are lm_head(norm(h)) either way.")
    if model.config.eagle_aux_hidden_state_layer_ids is None:
        extras["notes"].append(
            "eagle_aux_hidden_state_layer_ids is null: speculators then uses 3 aux states, and its training "
            "default for the ids is [2, L//2, L-3] of the verifier's L layers (resolve_target_layer_ids).")

    io = {
        "input_ids": input_ids, "hidden_states": hidden_states, "position_ids": position_ids,
        "logits": logits[0], "hidden_out": layer_out[0],
        "input_ids_ttt1": torch.cat([input_ids[:, 1:], input_ids.new_zeros(1, 1)], dim=-1),
        "hidden_ttt1_in": hidden_ttt1_in, "position_ids_ttt1": position_ids + 1, "logits_ttt1": logits[1],
    }
    save_file({k: v.contiguous() for k, v in io.items()}, str(variant_dir / "io.safetensors"))
    meta = meta_for(name, seed, spec, model, extras)
    (variant_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")

    saved = load_file(str(head_dir / "model.safetensors"))
    assert all(t.dtype in (torch.float32, torch.int64, torch.bool) for t in saved.values())
    return {"variant": name, "keys": {k: list(v.shape) for k, v in sorted(saved.items())},
            "sha256_logits": hashlib.sha256(logits[0].numpy().tobytes() + logits[1].numpy().tobytes()).hexdigest()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--extra", action="store_true", help="also write the norm_before_fc and qwen3 variants")
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    variants = {**VARIANTS, **(EXTRA_VARIANTS if args.extra else {})}
    for name, (seed, spec) in variants.items():
        summary = write_variant(args.out, name, seed, spec)
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
