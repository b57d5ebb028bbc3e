"""The profiler's sampling stage: acceptance per sampling setting and candidate scheme.

For each requested setting (temperature, top-k, top-p) and each scheme (the draft's top tokens,
draws from its distribution), the prompts are decoded through `SpecDecoder` at a reference budget
(the drafter's default, full trees verified), and the steps give the mean accepted length, the
schemes' common yardstick. Each scheme's acceptance calibration is fitted on the exact per-node
acceptance probabilities of steps at the shape controllers draft it in: top candidates at the
reference budget (controllers cut its trees), sampled candidates as chains of `sampled_chain`
nodes, decoded once more (see `moe_spec.profile.sampling_acceptance`). Greedy decoding is the main profile's; not measured here.
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
    sampled_chain: int | None = 5,
) -> tuple[SettingAcceptance, ...]:
    """One entry per (setting, scheme), each from the same prompts, budget and generator seed;
    `sampled_chain`: the chain the sampled calibration is fitted on (None: the reference budget).
    `tick` is called once per prompt decoded (`decodes_per_setting` times per setting and prompt)."""
    if sampled_chain is not None and sampled_chain < 1:
        raise ValueError(f"sampled_chain must be a positive number of nodes or None, got {sampled_chain}")
    entries = []
    for sampling in settings:
        if sampling.greedy:
            raise ValueError("sampling settings need temperature > 0 (greedy is profiled anyway)")
        for sampled in (False, True):
            def decoded(shape: TreeBudget) -> list:
                generator = torch.Generator().manual_seed(seed)
                traces = decode_prompts(target, drafter, prompts, max_new_tokens, shape, tick, sampling=sampling,
                                        generator=generator)
                return [(t.prompt_index, s) for t in traces for s in t.steps if s.speculated]
            steps = decoded(budget.with_scheme(sampled))
            mean_accepted = float(np.mean([s.tokens_produced for _, s in steps])) if steps else 1.0
            measured, shape, chain = len(steps), "reference", ()
            if sampled and sampled_chain is not None:
                steps, shape = decoded(TreeBudget(sampled_chain, sampled_chain, 1, sampled=True)), f"chain:{sampled_chain}"
            samples = NodeSamples.from_steps([s for _, s in steps], [group for group, _ in steps])
            calibration = AcceptanceCalibration.fit(samples) if len(samples) >= MIN_CALIBRATION_NODES else None
            if shape != "reference":
                chain = per_depth_conditional(samples, sampled_chain)
            entries.append(SettingAcceptance(sampling.temperature, sampling.top_k, sampling.top_p, sampled,
                                             mean_accepted, measured, budget.max_nodes, calibration, shape, chain))
    return tuple(entries)


def per_depth_conditional(samples: NodeSamples, depths: int) -> tuple[float, ...]:
    """Mean P(accepted | parent reached) of the nodes whose parent was reached, per depth 1..`depths`
    (cut where a depth has no such node)."""
    means = []
    for depth in range(1, depths + 1):
        reached = samples.parent_reached & (samples.depth == depth)
        if not reached.any():
            break
        means.append(float(samples.conditional_accepted[reached].mean()))
    return tuple(means)


def decodes_per_setting(sampled_chain: int | None = 5) -> int:
    """How many times `sampling_acceptance` decodes each prompt per setting."""
    return 2 + (sampled_chain is not None)
