"""The bound replayed: `moe-aware`'s choice among its sizing, fixed budgets and plain decoding,
made on traced steps by the same `BudgetBandit` a real run uses.

A real `moe-aware` run (`BoundedController`) decides each step by one of its arms and measures what
the step made and cost. On a trace every arm's outcome of every step is known from its own replay
(`replay.replay_policy`: the sizing with its gate off, each `static:N`, `ar` for plain decoding),
so the bandit can be run over them as it would run live: it chooses an arm, records that arm's
replayed tokens and ms, and credits the arms the step tells (plain decoding one token; after a
fixed budget's step every smaller fixed budget's replayed tokens, exact on a greedy trace, as
`fewer_nodes` computes them live). A request's first `settle_steps` steps are decided but not
judged, as live.

What it shows beside the arms' own replays: what choosing online costs against the best arm in
hindsight on the same steps (the bandit's regret), and how the decisions split. `noise` multiplies
each recorded ms by a lognormal factor of that relative spread (seeded), since live step times
move and the replay's do not; 0 replays the cost model exactly.

Not modelled, beyond what every replay leaves out: the trajectory (each arm is scored on the
prefix EAGLE-2 reached), and that a live sizing learns online from its own steps.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from moe_spec.policy.arm_windows import RequestDifficulty
from moe_spec.policy.bounded_controller import FIXED_ARMS, PLAIN, SETTLE_STEPS, SIZED
from moe_spec.policy.budget_bandit import EXPLORATION, HORIZON, MIN_PLAYS, WINDOW, BudgetBandit, RegimeKey

BOUNDED = "moe-aware, bounded (replay)"


@dataclass(frozen=True)
class BoundSettings:
    """The bandit's parameters, as `BudgetBandit` and `BoundedController` take them."""

    exploration: float = EXPLORATION
    window: int = WINDOW
    horizon: int | None = HORIZON
    min_plays: int = MIN_PLAYS
    settle_steps: int = SETTLE_STEPS
    fixed: tuple[int, ...] = FIXED_ARMS
    noise: float = 0.0  # relative spread of the lognormal factor on each step's ms
    seed: int = 0
    priors: tuple[tuple[str, float], ...] = ()  # (arm, rate) the profile measured: the bandit's prior, as live
    # arms judged at the request's difficulty, shrunk towards the run's by this many steps (None: the run's)
    request_prior_steps: float | None = None


def replay_bound(prompts: Sequence[int], sized: Sequence, fixed: dict[int, Sequence], plain: Sequence,
                 settings: BoundSettings = BoundSettings()) -> tuple[list, Counter]:
    """The step the bandit chose on each traced step, among `sized` (the sizing's replayed steps,
    gate off), the `fixed` budgets' (nodes -> `static:nodes`'s replayed steps) and `plain` (`ar`'s),
    each a `replay.ReplayedStep` per step of a greedy trace, `prompts` giving each step's prompt
    (a new one starts a request); and the steps each arm decided."""
    missing = [n for n in settings.fixed if n not in fixed]
    if missing:
        raise ValueError(f"no replay of the fixed budgets {missing}")
    nodes = {f"static:{n}": n for n in settings.fixed}
    arms = {SIZED: sized, **{name: fixed[n] for name, n in nodes.items()}, PLAIN: plain}
    key = RegimeKey(0.0, 0, 1.0, 1)  # one regime: the trace's
    bandit = BudgetBandit(tuple(arms), exploration=settings.exploration, window=settings.window,
                          min_plays=settings.min_plays, horizon=settings.horizon,
                          priors={key: dict(settings.priors)} if settings.priors else None)
    jitter = random.Random(settings.seed)
    chosen: list = []
    decisions: Counter = Counter()
    prompt, steps_in_prompt = None, 0
    difficulty = RequestDifficulty(settings.request_prior_steps) if settings.request_prior_steps else None
    following = bandit.choose(key)
    for index, request in enumerate(prompts):
        if request != prompt:
            prompt, steps_in_prompt = request, 0
            if difficulty is not None:
                difficulty.reset()
        # as live, the next step's arm is chosen when this step is planned, before it is judged
        arm, following = following, bandit.choose(key, difficulty=difficulty)
        outcome = arms[arm][index]
        if settings.noise > 0:
            factor = math.exp(jitter.gauss(0.0, settings.noise))
            outcome = replace(outcome, verify_ms=outcome.verify_ms * factor, draft_ms=outcome.draft_ms * factor)
        chosen.append(outcome)
        decisions[arm] += 1
        steps_in_prompt += 1
        # as live, a step that drafts tells its difficulty: what its best node alone makes
        reference = float(fixed[1][index].tokens) if 1 in fixed and arm != PLAIN else None
        if difficulty is not None and reference is not None:
            difficulty.add(reference)
        if steps_in_prompt > settings.settle_steps:
            played = nodes.get(arm, 0)
            credits = {PLAIN: 1.0, **{name: float(arms[name][index].tokens) for name, n in nodes.items() if n < played}}
            bandit.record(key, arm, float(outcome.tokens), outcome.verify_ms + outcome.draft_ms, credits=credits,
                          reference=reference)
    return chosen, decisions
