"""The bound replayed on known per-step outcomes: it finds the best arm, and credits what steps tell."""

from __future__ import annotations

import random

import pytest

from moe_spec.experiments.bound_replay import BoundSettings, replay_bound
from moe_spec.experiments.replay import ReplayedStep
from moe_spec.policy.bounded_controller import FIXED_ARMS, PLAIN, SIZED

STEPS = 1200


def outcomes(tokens_of, ms: float, seed: int) -> list[ReplayedStep]:
    """One arm's replayed steps: `tokens_of(rng)` tokens at `ms` each."""
    rng = random.Random(seed)
    return [ReplayedStep((0,), tokens_of(rng), ms, 0.0, (4,)) for _ in range(STEPS)]


def nested_arms(acceptance: list[float], ms_of_nodes) -> dict[int, list[ReplayedStep]]:
    """Fixed budgets whose trees nest, as EAGLE-2's top nodes do: on each step a budget of n nodes
    accepts the first min(n, depth reached) of a chain drawn once for all of them."""
    rng = random.Random(7)
    reached = []
    for _ in range(STEPS):
        depth = 0
        while depth < len(acceptance) and rng.random() < acceptance[depth]:
            depth += 1
        reached.append(depth)
    return {n: [ReplayedStep((0,), 1 + min(n, d), ms_of_nodes(n), 0.0, (4,)) for d in reached] for n in FIXED_ARMS}


def rate(steps: list[ReplayedStep]) -> float:
    return sum(s.tokens for s in steps) / sum(s.verify_ms + s.draft_ms for s in steps)


def test_the_bound_settles_on_the_best_fixed_budget_and_stays_near_its_rate():
    fixed = nested_arms([0.9, 0.9, 0.1, 0.1, 0.1, 0.1], lambda n: 10.0 + 2.0 * n)  # static:2 best by 11%
    sized = outcomes(lambda rng: 1 + int(rng.random() < 0.5), 14.0, seed=1)  # worse than every budget but one
    plain = outcomes(lambda rng: 1, 10.0, seed=2)
    chosen, decisions = replay_bound([i // 40 for i in range(STEPS)], sized, fixed, plain, BoundSettings())
    best = max(fixed, key=lambda n: rate(fixed[n]))
    assert len(chosen) == STEPS and sum(decisions.values()) == STEPS
    assert decisions.most_common(1)[0][0] == f"static:{best}"
    assert rate(chosen) >= 0.93 * rate(fixed[best])
    assert decisions[SIZED] < 0.1 * STEPS and decisions[PLAIN] < 0.1 * STEPS


def test_every_step_is_one_arms_outcome_and_jitter_moves_only_its_time():
    fixed = nested_arms([0.6] * 6, lambda n: 10.0 + n)
    sized = outcomes(lambda rng: 2, 12.0, seed=1)
    plain = outcomes(lambda rng: 1, 9.0, seed=2)
    prompts = [i // 50 for i in range(STEPS)]
    exact, _ = replay_bound(prompts, sized, fixed, plain)
    arms = [sized, plain, *fixed.values()]
    assert all(any(step == arm[i] for arm in arms) for i, step in enumerate(exact))
    jittered, _ = replay_bound(prompts, sized, fixed, plain, BoundSettings(noise=0.1))
    assert any(a.verify_ms != b.verify_ms for a, b in zip(exact, jittered))
    assert all(any(step.tokens == arm[i].tokens and step.keep == arm[i].keep for arm in arms) for i, step in enumerate(jittered))


def test_plain_decoding_wins_where_no_draft_pays():
    fixed = nested_arms([0.05] * 6, lambda n: 15.0 + 2 * n)
    sized = outcomes(lambda rng: 1, 16.0, seed=1)
    plain = outcomes(lambda rng: 1, 10.0, seed=2)
    chosen, decisions = replay_bound([i // 40 for i in range(STEPS)], sized, fixed, plain)
    assert decisions.most_common(1)[0][0] == PLAIN
    assert rate(chosen) >= 0.9 * rate(plain)


def test_a_missing_fixed_budget_is_refused():
    fixed = nested_arms([0.5] * 6, lambda n: 10.0 + n)
    del fixed[3]
    with pytest.raises(ValueError, match=r"fixed budgets \[3\]"):
        replay_bound([0] * STEPS, fixed[1], fixed, fixed[1])


def test_a_measured_prior_spares_the_replayed_bound_its_exploration():
    fixed = nested_arms([0.9, 0.9, 0.1, 0.1, 0.1, 0.1], lambda n: 10.0 + 2.0 * n)
    sized = outcomes(lambda rng: 1 + int(rng.random() < 0.5), 14.0, seed=1)
    plain = outcomes(lambda rng: 1, 10.0, seed=2)
    prior = ((SIZED, rate(sized)), (PLAIN, rate(plain)), *((f"static:{n}", rate(steps)) for n, steps in fixed.items()))
    prompts = [i // 40 for i in range(STEPS)]
    _, without = replay_bound(prompts, sized, fixed, plain, BoundSettings())
    chosen, with_prior = replay_bound(prompts, sized, fixed, plain, BoundSettings(priors=prior))
    assert with_prior[SIZED] + with_prior[PLAIN] < without[SIZED] + without[PLAIN]
    assert rate(chosen) >= 0.97 * max(rate(steps) for steps in fixed.values())


def test_judged_at_the_requests_difficulty_the_bound_decodes_hard_requests_plainly():
    """Requests alternate: easy ones accept a deep tree's drafts (static:6 best), hard ones accept
    none (plain decoding best). At the run's difficulty one arm serves both; at each request's, the
    hard requests go plain."""
    rng = random.Random(3)
    prompts = [i // 40 for i in range(STEPS)]
    depth = [min(6, sum(1 for _ in iter(lambda: rng.random() < 0.85, False))) if prompts[i] % 2 == 0 else 0
             for i in range(STEPS)]
    fixed = {n: [ReplayedStep((0,), 1 + min(n, d), 10.0 + 1.5 * n, 0.0, (4,)) for d in depth] for n in FIXED_ARMS}
    sized = [ReplayedStep((0,), 1 + min(6, d), 20.0, 0.0, (4,)) for d in depth]
    plain = outcomes(lambda rng: 1, 10.0, seed=2)
    hard = [i for i in range(STEPS) if prompts[i] % 2 and i % 40 >= 8]  # past each hard request's first steps

    def plain_share_on_hard(settings: BoundSettings) -> float:
        chosen, _ = replay_bound(prompts, sized, fixed, plain, settings)
        return sum(chosen[i] is plain[i] for i in hard) / len(hard), rate(chosen)

    (run_plain, run_rate), (request_plain, request_rate) = (
        plain_share_on_hard(BoundSettings(request_prior_steps=steps)) for steps in (None, 4.0))
    assert request_plain > run_plain + 0.2
    assert request_rate > run_rate
