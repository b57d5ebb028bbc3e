"""Shared helpers for moe_spec's tests and examples: prompts, transformers' own greedy decoding as
the reference, and a random (but decisive) EAGLE head for any target."""

from __future__ import annotations

import torch

from moe_spec.testing.tiny_models import DENSE_ARCHITECTURES, MOE_ARCHITECTURES

ALL_ARCHITECTURES = MOE_ARCHITECTURES + DENSE_ARCHITECTURES

REPETITIVE_PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
PLAIN_PROMPT = [11, 42, 7, 63, 20, 3, 88, 15, 31, 54]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> torch.Tensor:
    """transformers' own greedy decoding on the model's device, returned on the host; it stops at
    the model's EOS, as SpecDecoder does by default."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=0)
    return out.cpu()


def assert_speculated(stats) -> None:
    """Drafts were verified and some accepted (a step made more tokens than it had rows): a lossless
    comparison where nothing was speculated would compare plain decoding with itself."""
    assert sum(step.tree_size for step in stats.steps) > 0, "no drafted node was verified"
    assert any(step.accepted_length > step.rows for step in stats.steps), "no drafted token was accepted"


def law_after_the_first_token(next_probs, vocab: int, tokens: int) -> torch.Tensor:
    """[V] * (tokens - 1) P(x2, ..., x_tokens | prompt) = sum over x1 of P(x1) P(x2 | x1) ..., by
    enumerating every continuation; `next_probs(new_tokens) -> [V]` is the next token's law after
    the prompt and `new_tokens` (the caller's own: the package's sampling, or transformers')."""

    def joint(prefix: list[int], remaining: int) -> torch.Tensor:  # [V] * remaining, the laws of the next ones
        p = next_probs(prefix)
        if remaining == 1:
            return p
        return torch.stack([p[x] * joint(prefix + [x], remaining - 1) for x in range(vocab)])

    with torch.no_grad():
        return joint([], tokens).sum(0)


def exact_distribution_of_tokens_2_and_3(model, prompt: list[int], vocab: int, config) -> torch.Tensor:
    """[V, V] P(x2, x3 | prompt) with the package's own sampling law (`config`: a `SamplingConfig`),
    forwards on the model's device, probabilities on the host."""
    from moe_spec.core.sampling import probabilities

    def next_probs(tokens):
        logits = model(torch.tensor([prompt + tokens], device=model.device)).logits[0, -1]
        return probabilities(logits.cpu(), config)

    return law_after_the_first_token(next_probs, vocab, 3)


def assert_follows(counts: torch.Tensor, exact: torch.Tensor) -> None:
    """Chi-square of sampled pair counts against exact pair probabilities (rare cells merged so every
    expected count is >= 5); never a pair the target gives zero probability."""
    from scipy.stats import chisquare

    assert counts[exact == 0].sum() == 0, "sampled a pair the target gives zero probability"
    support = exact > 0
    expected = exact[support] / exact[support].sum() * counts.sum()
    observed = counts[support]
    rare = expected < 5
    observed = torch.cat([observed[~rare], observed[rare].sum(0, keepdim=True)])
    expected = torch.cat([expected[~rare], expected[rare].sum(0, keepdim=True)])
    keep = expected > 0
    assert chisquare(observed[keep].numpy(), expected[keep].numpy()).pvalue > 1e-3


def random_eagle_head(target, draft_vocab: int = 64, seed: int = 0):
    """A random EAGLE head for `target` over `draft_vocab` random target tokens, made decisive (a
    wide output layer) so its trees are not near-uniform. Seeded by its own generator."""
    from moe_spec.drafters.eagle_config import config_for_target
    from moe_spec.drafters.eagle_head import EagleHead

    generator = torch.Generator().manual_seed(seed)
    d2t = torch.randperm(target.vocab_size, generator=generator)[:draft_vocab]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = EagleHead(config_for_target(target, draft_vocab_size=draft_vocab), d2t)
        with torch.no_grad():
            head.lm_head.weight.normal_(0.0, 0.5)
    return head.eval()


def random_prompt(n: int = 12, seed: int = 0) -> torch.Tensor:
    """[n] long random token ids in [3, 96), the same for the same seed."""
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed))


def target_features(target, tokens: torch.Tensor) -> torch.Tensor:
    """[T, S, D] a `TargetModel`'s feature layers for a token sequence [T]."""
    with target.reading_features() as read:
        return read(target.model(tokens[None], output_hidden_states=True))[0].detach()


def begun_eagle_drafter(target, head, *prompts: torch.Tensor):
    """An `EagleDrafter` begun on each prompt minus its last token (the pending root), as the engine does."""
    from moe_spec.drafters.eagle import EagleDrafter

    drafter = EagleDrafter(head, target)
    drafter.begin([p[:-1] for p in prompts], [target_features(target, p[:-1]) for p in prompts])
    return drafter
