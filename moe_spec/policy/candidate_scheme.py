"""Which candidates a sampling request drafts: the draft's top tokens or draws from its distribution.

Under greedy decoding only top tokens make sense (a draw at temperature 0 is the top token). Under
sampling, deterministic candidates are accepted with the target's mass on them, sampled ones with
1 - TV(p, q) for one candidate (see `moe_spec.core.acceptance`); which wins depends on the draft
head, the temperature and top-p. `auto` takes the one the profile *measured* to accept more at the
nearest profiled setting (`Profile.sampling_acceptance`), and says so when no setting matches the
request exactly; a profile that measured no sampling setting keeps top tokens, flagged.

A sampled tree must be verified as drafted: any cut that looks at what was drawn (its tokens, their
scores or experts) biases the output, so controllers size sampled trees only through the budget
they give the drafter for the next step.
"""

from __future__ import annotations

import warnings
from enum import Enum

from moe_spec.core.drafting import TreeBudget
from moe_spec.core.forest import StepForest
from moe_spec.core.sampling import SamplingConfig


class CandidateScheme(str, Enum):
    TOP = "top"
    SAMPLED = "sampled"
    AUTO = "auto"


def resolve_scheme(scheme: CandidateScheme, sampling: SamplingConfig, profile=None) -> bool:
    """True when this request drafts sampled candidates."""
    if sampling.greedy or scheme is CandidateScheme.TOP:
        return False
    if scheme is CandidateScheme.SAMPLED:
        return True
    if profile is None:
        warnings.warn("candidates: no profile says which scheme accepts more; drafting top tokens (name one: "
                      "METHOD@top or METHOD@sampled)", stacklevel=3)
        return False
    if not profile.sampling_acceptance:
        warnings.warn("candidates: the profile measured no sampling setting; drafting top tokens (measure them "
                      "with scripts/profile_sampling.py, or name one: METHOD@top or METHOD@sampled)", stacklevel=3)
        return False
    choice = profile.preferred_scheme(sampling)
    if not choice.exact:
        warnings.warn(f"candidates: no profiled setting matches temperature {sampling.temperature}, top-k "
                      f"{sampling.top_k}, top-p {sampling.top_p}; using the nearest ({choice.setting})", stacklevel=3)
    return choice.sampled


def with_scheme(budget: TreeBudget, sampled: bool) -> TreeBudget:
    return budget if budget.sampled == sampled else budget.with_scheme(sampled)


def drawn(candidates: StepForest) -> bool:
    """Some row's candidates were sampled: the step verifies them as drafted."""
    return any(tree.sampled for tree in candidates)
