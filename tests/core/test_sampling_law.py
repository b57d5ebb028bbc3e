"""Sampled decoding follows the target's law past the first speculative step and in padded rows.

The reference is computed independently of moe_spec: transformers' own logits processors
(temperature, top-p) on the model's own logits, then a plain softmax, enumerated over every
continuation. The law tested is that of the 2nd, 3rd and 4th new tokens: the 1st comes from the
prefill, and with at most two drafted nodes a step, the 3rd and 4th come from the second or third
speculative step whenever a draft was rejected. A batch of four rows decodes two prompts twice each;
the shorter is left-padded, and the two rows of a prompt draw from the same law, so their draws pool.

Power: 3000 batches give 6000 draws of each law over 27 cells (vocabulary 3). Against the hardest
alternative at a total-variation distance of 0.05 from a law (a shift spread in proportion over half
the mass, whose chi-square noncentrality is 4 * 0.05^2 * 6000 = 60; `power_against_tv`), the
chi-square test at p < 1e-3 rejects with probability >= 0.9 for the cells as merged (the test
computes it); the biased sampler of the last test, 5% of every draw's mass moved from the likeliest
token to the least likely, is rejected."""

import pytest
import torch
from scipy.stats import chi2, chisquare, ncx2
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from moe_spec.experiments.runner import left_pad
from moe_spec import SpecDecoder, TreeBudget
from moe_spec.core.target import TargetModel
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.testing.helpers import law_after_the_first_token, random_eagle_head
from moe_spec.testing.tiny_models import tiny_model

VOCAB = 3
PROMPTS = ([1, 0, 2, 2, 1], [2, 1, 0])
ROWS = (0, 0, 1, 1)  # the prompt of each row of the batch
BATCHES = 3000
TV = 0.05
ALPHA = 1e-3
CONFIGS = {"t1": dict(temperature=1.0), "t0.7-top-p0.9": dict(temperature=0.7, top_p=0.9)}


def reference_law(model, prompt: list[int], temperature: float, top_p: float | None = None) -> torch.Tensor:
    """[V, V, V] P(x2, x3, x4 | prompt), from transformers' processors and a plain softmax."""
    warpers = [TemperatureLogitsWarper(temperature)] + ([TopPLogitsWarper(top_p)] if top_p is not None else [])

    def next_probs(tokens: list[int]) -> torch.Tensor:
        scores = model(torch.tensor([prompt + tokens])).logits[:, -1].double()
        for warp in warpers:
            scores = warp(None, scores)
        return scores.softmax(-1)[0]

    return law_after_the_first_token(next_probs, VOCAB, 4)  # [x2, x3, x4]


def merged_cells(counts: torch.Tensor, law: torch.Tensor, draws: int):
    """(observed, expected) with cells expected below 5 draws merged into one."""
    expected = law.flatten() * draws
    observed = counts.flatten().double()
    rare = expected < 5
    return (torch.cat([observed[~rare], observed[rare].sum(0, keepdim=True)]),
            torch.cat([expected[~rare], expected[rare].sum(0, keepdim=True)]))


def power_against_tv(cells: int, draws: int, tv: float = TV, alpha: float = ALPHA) -> float:
    """Power of the chi-square test against the TV-`tv` alternative of least noncentrality
    (sum of (q - p)^2 / p is smallest, 4 tv^2, for a shift spread in proportion over half the mass)."""
    critical = chi2.ppf(1 - alpha, cells - 1)
    return float(ncx2.sf(critical, cells - 1, 4 * tv**2 * draws))


def sampled_counts(model, temperature: float, top_p: float = 1.0) -> list[torch.Tensor]:
    """[V, V, V] counts of (x2, x3, x4) per prompt, BATCHES batches of ROWS."""
    target = TargetModel(model)
    drafter = EagleDrafter(random_eagle_head(target, draft_vocab=VOCAB), target, TreeBudget(2, 2, 1))
    decoder = SpecDecoder(target, drafter=drafter)
    ids, mask = left_pad([torch.tensor([PROMPTS[p]]) for p in ROWS], pad=0)  # [B, width] each
    width = ids.shape[1]
    generator = torch.Generator().manual_seed(11)
    counts = [torch.zeros(VOCAB, VOCAB, VOCAB) for _ in PROMPTS]
    drafted = 0
    for _ in range(BATCHES):
        out = decoder.generate(ids, attention_mask=mask, max_new_tokens=4, temperature=temperature, top_p=top_p,
                               eos_token_id=[], generator=generator)
        for row, prompt in enumerate(ROWS):
            _, x2, x3, x4 = out.sequences[row, width:].tolist()
            counts[prompt][x2, x3, x4] += 1
        drafted += sum(step.tree_size for step in out.stats.steps)
    assert drafted > 0, "drafts were verified"
    return counts


def chi_square_pvalues(model, temperature: float, top_p: float | None = None) -> list[float]:
    """The p-value of each prompt's sampled law against its reference, after checking the test's power."""
    counts = sampled_counts(model, temperature, 1.0 if top_p is None else top_p)
    pvalues = []
    for prompt, sampled in zip(PROMPTS, counts, strict=True):
        draws = int(sampled.sum())
        law = reference_law(model, prompt, temperature, top_p)
        assert sampled[law == 0].sum() == 0, "sampled a continuation the target gives zero probability"
        observed, expected = merged_cells(sampled, law, draws)
        keep = expected > 0
        assert power_against_tv(int(keep.sum()), draws) >= 0.9, "the draws detect a TV shift of 0.05"
        pvalues.append(float(chisquare(observed[keep].numpy(), expected[keep].numpy()).pvalue))
    return pvalues


def _model():
    return tiny_model("qwen3_moe", vocab_size=VOCAB, seed=5)


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_later_tokens_of_padded_rows_follow_transformers_law(config):
    assert min(chi_square_pvalues(_model(), **CONFIGS[config])) > ALPHA


@pytest.mark.slow
def test_a_sampler_biased_by_five_percent_fails_the_law(monkeypatch):
    """The deliberately broken variant: every target distribution the engine and the acceptance read
    has 5% of its mass moved from its likeliest to its least likely token."""
    import moe_spec.core.acceptance as acceptance
    import moe_spec.core.engine as engine

    honest = acceptance.probabilities

    def biased(logits, config):
        p = honest(logits, config).clone()
        top, bottom = int(p.argmax()), int(p.argmin())
        shift = min(TV, float(p[top]))
        p[top] -= shift
        p[bottom] += shift
        return p

    monkeypatch.setattr(acceptance, "probabilities", biased)
    monkeypatch.setattr(engine, "probabilities", biased)
    assert max(chi_square_pvalues(_model(), temperature=1.0)) < ALPHA
