"""Shared helpers for moe_spec's tests and examples: prompts, transformers' own greedy decoding as
the reference, and a random (but decisive) EAGLE head for any target."""

from __future__ import annotations

import torch

from moe_spec.testing.tiny_models import DENSE_ARCHITECTURES, MOE_ARCHITECTURES

ALL_ARCHITECTURES = MOE_ARCHITECTURES + DENSE_ARCHITECTURES

REPETITIVE_PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
PLAIN_PROMPT = [11, 42, 7, 63, 20, 3, 88, 15, 31, 54]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> torch.Tensor:
    """transformers' own greedy decoding; it stops at the model's EOS, as SpecDecoder does by default."""
    ids = torch.tensor([prompt])
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)


def random_eagle_head(target, draft_vocab: int = 64, seed: int = 0):
    """A random EAGLE head for `target` over `draft_vocab` random target tokens, made decisive (a
    wide output layer) so its trees are not near-uniform. Seeded by its own generator."""
    from moe_spec.drafters.eagle_head import EagleHead, config_for_target

    generator = torch.Generator().manual_seed(seed)
    d2t = torch.randperm(target.vocab_size, generator=generator)[:draft_vocab]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = EagleHead(config_for_target(target, draft_vocab_size=draft_vocab), d2t)
        with torch.no_grad():
            head.lm_head.weight.normal_(0.0, 0.5)
    return head.eval()
