"""The profile's arm stage: every arm of `moe-aware`'s bound decoding the profile's prompts on its
own, per sampling setting, so that a live run's bandit starts from what each measured
(`moe_spec.profile.arm_rates`) instead of playing every arm to judge it.

Each arm runs as it runs live: a `BoundedController` over one shared sizing whose bandit holds that
arm alone, so fixed budgets take the shape the request's candidates give them (`static:N` or
`chain:N`), and the sizing learns across requests from its own and plain steps. A step counts from
its start to the next step's start, as the bandit counts it (a request's last step: drafting to
acceptance), and a request's first `SETTLE_STEPS` not at all.
The arms take turns request by request, in an order that rotates, so a slow spell of the machine
falls on all of them. With `rows` > 1 each request is a batch of that many prompts (taken in turn,
cycling when too few), the batch size the rates are keyed by. An offloaded target's arms are
measured offloaded, each request from a cold cache as a bench runs it, and keyed by its cache size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moe_spec.core.drafting import Drafter
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.inputs import left_pad
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.step_record import DecodeObserver, StepRecord
from moe_spec.core.target import TargetModel
from moe_spec.policy.bounded_controller import SETTLE_STEPS, BoundedController, charged_ms
from moe_spec.policy.budget_bandit import BudgetBandit
from moe_spec.policy.registry import build_controller
from moe_spec.profile.arm_rates import ArmRates


class StepCounter(DecodeObserver):
    """Each step's tokens, rows and time, as the bound judges its arms."""

    def __init__(self):
        self._steps: list[tuple[float, int, float, float]] = []  # (tokens, rows, started s, step ms) per step

    def on_step(self, record: StepRecord) -> None:
        self._steps.append((float(record.tokens_produced), record.batch, record.started, record.step_ms))

    @property
    def records(self) -> list[tuple[float, int, float]]:
        """(tokens, rows, ms) per step, each step until the next one's start (the last: its own time)."""
        starts = [step[2] for step in self._steps[1:]] + [None]
        return [(tokens, rows, charged_ms(started, ms, following))
                for (tokens, rows, started, ms), following in zip(self._steps, starts)]


def arm_rates_stage(
    target: TargetModel,
    drafter: Drafter,
    profile,  # the `Profile` the sizing prices with
    prompts: Sequence[torch.Tensor],  # each [T] long
    samplings: Sequence[SamplingConfig],
    max_new_tokens: int,
    rows: int = 1,
    seed: int = 0,
    tick: Callable[[], None] = lambda: None,  # once per request and setting
) -> tuple[ArmRates, ...]:
    """One `ArmRates` per sampling setting, for batches of `rows`, every arm allowed for that setting."""
    if max_new_tokens <= SETTLE_STEPS:
        raise ValueError(f"max_new_tokens must exceed the {SETTLE_STEPS} settling steps, got {max_new_tokens}")
    if rows < 1 or not prompts:
        raise ValueError(f"arm rates need prompts and rows >= 1, got {len(prompts)} prompts and rows {rows}")
    requests = [left_pad([prompts[(start + i) % len(prompts)][None] for i in range(rows)], pad=0)
                for start in range(0, len(prompts), rows)]  # (input_ids [rows, T], attention_mask [rows, T])
    offload = target.offload
    bounded = build_controller("moe-aware", lambda: profile, residency=offload.residency if offload is not None else None)
    entries = []
    for sampling in samplings:
        bounded.begin(drafter.default_budget, sampling)
        arms = bounded.allowed_arms
        made, spent, steps = dict.fromkeys(arms, 0.0), dict.fromkeys(arms, 0.0), dict.fromkeys(arms, 0)
        row_steps = dict.fromkeys(arms, 0)
        for index, (input_ids, attention_mask) in enumerate(requests):
            for arm in arms[index % len(arms):] + arms[: index % len(arms)]:
                counter = StepCounter()
                if offload is not None:
                    offload.clear()
                controller = BoundedController(bounded.sizing, bandit=BudgetBandit((arm,)))
                SpecDecoder(target, drafter, controller, observer=counter).generate(
                    input_ids, attention_mask, max_new_tokens=max_new_tokens, eos_token_id=[],
                    temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                    generator=torch.Generator().manual_seed(seed * 1_000_003 + index))
                for tokens, step_rows, ms in counter.records[SETTLE_STEPS:]:
                    made[arm] += tokens
                    spent[arm] += ms
                    steps[arm] += 1
                    row_steps[arm] += step_rows
            tick()
        measured = [arm for arm in arms if steps[arm] and spent[arm] > 0]
        entries.append(ArmRates(sampling, rows, {arm: made[arm] / spent[arm] for arm in measured},
                                {arm: steps[arm] for arm in measured},
                                offload.config.resident if offload is not None else None,
                                {arm: made[arm] / row_steps[arm] for arm in measured}))
    return tuple(entries)
