"""The profiler's sampling stage: acceptance per sampling setting and candidate scheme.

For each requested setting (temperature, top-k, top-p) and each scheme (the draft's top tokens,
draws from its distribution), the prompts are decoded through `SpecDecoder` at a reference budget
(the drafter's default, full trees verified), and the steps give the mean accepted length and an
acceptance calibration fitted on their exact per-node acceptance probabilities (see
`moe_spec.profile.sampling_acceptance`). Greedy decoding is the main profile's; not measured here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from moe_spec.core.drafting import BatchDrafter, Drafter, TreeBudget
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.target import TargetModel
from moe_spec.measure.decoding import decode_prompts
from moe_spec.profile.calibration import AcceptanceCalibration, NodeSamples
from moe_spec.profile.sampling_acceptance import SettingAcceptance

MIN_CALIBRATION_NODES = 50  # fewer drafted nodes than this fit no calibration


def sampling_acceptance(
    target: TargetModel,
    drafter: Drafter | BatchDrafter,
    prompts: Sequence[torch.Tensor],  # each [T] long
    settings: Sequence[SamplingConfig],
    budget: TreeBudget,
    max_new_tokens: int,
    seed: int = 0,
    tick: Callable[[], None] = lambda: None,
) -> tuple[SettingAcceptance, ...]:
    """One entry per (setting, scheme), each from the same prompts, budget and generator seed."""
    entries = []
    for sampling in settings:
        if sampling.greedy:
            raise ValueError("sampling settings need temperature > 0 (greedy is profiled anyway)")
        for sampled in (False, True):
            generator = torch.Generator().manual_seed(seed)
            traces = decode_prompts(target, drafter, prompts, max_new_tokens, budget.with_scheme(sampled), tick,
                                    sampling=sampling, generator=generator)
            steps = [s for t in traces for s in t.steps if s.speculated]
            groups = [t.prompt_index for t in traces for s in t.steps if s.speculated]
            samples = NodeSamples.from_steps(steps, groups)
            calibration = AcceptanceCalibration.fit(samples) if len(samples) >= MIN_CALIBRATION_NODES else None
            mean_accepted = float(np.mean([s.tokens_produced for s in steps])) if steps else 1.0
            entries.append(SettingAcceptance(sampling.temperature, sampling.top_k, sampling.top_p, sampled,
                                             mean_accepted, len(steps), budget.max_nodes, calibration))
    return tuple(entries)
