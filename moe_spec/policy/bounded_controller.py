"""`BoundedController`: the cost model's per-step sizing, kept no worse than the best fixed budget.

The sizing (`MoeAwareController`) prices every candidate by its calibrated acceptance and the
experts it newly loads, and wins where those predictions hold; where they do not (sampled steps
whose acceptance swings, experts missing from an offload cache) a fixed one- to three-node tree or
plain decoding has beaten it. So the sizing is one arm of a `BudgetBandit` whose other arms are
plain decoding and a few fixed budgets (`static:N`, run exactly as the `static:N` method runs), and
each step is decided by the arm of highest upper confidence bound on its measured throughput. The
sizing decides as long as it measures at least as well as the best of them; the plain arm replaces
the sizing's own pause-and-probe gate. Where the profile measured the arms on its own prompts
(`Profile.arm_rates`), the bandit starts from those rates instead of playing every arm to judge it.

The fixed budgets take the shape their method gives the request's candidates: EAGLE-2's depth and
branching (`static:N`) for top candidates, a chain (`chain:N`) for sampled ones, whose sampled
trees with siblings accept little more than the chain's first node (offloaded, T = 1: `static:4`
1.84 tokens a step against 1.53 for one node) and tell nothing of smaller ones (`fewer_nodes`).

A step is charged what it cost the caller: from its start to the next step's start (draft, plan,
verify, acceptance, and the controller's own `observe` and the loop's bookkeeping after it, which
grow with the tree), so each step is recorded once the next one begins; a request's last step,
which no step follows, is charged its own time and its `observe`. Its tokens are what it makes on
average given its drafts (`fewer_nodes`: exact, without the luck of sampled acceptance
draws; under greedy decoding the tokens made). A step also credits the arms whose tokens it tells:
plain decoding's (one a row) after every step, and every smaller fixed budget's after a fixed
budget's step, so exploring the larger budget measures the smaller ones' acceptance on the same
steps (a sized chain credits none: it drafts far only on the steps it finds promising). And every
step that drafts tells the bandit its difficulty alike, whichever arm decided it (the tokens its
best drafted node alone makes), so that each arm's tokens are judged at the run's difficulty, not
at that of the requests it happened to decide (`BudgetBandit`). The sizing's own steps and plain
ones teach its online corrections (machine speed, acceptance per depth); a fixed arm's step is not
learnt from (predicting its pass afresh cost more than its whole plan).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Literal, NamedTuple

from moe_spec.core.control import StepPlan
from moe_spec.core.drafting import EAGLE2_BUDGET, NO_DRAFT, TreeBudget
from moe_spec.core.forest import StepForest
from moe_spec.core.sampling import GREEDY, SamplingConfig
from moe_spec.core.step_record import StepRecord
from moe_spec.policy.arm_windows import RequestDifficulty
from moe_spec.policy.budget_bandit import BudgetBandit, RegimeKey
from moe_spec.policy.fewer_nodes import tokens_by_budget
from moe_spec.policy.moe_aware import MoeAwareController
from moe_spec.policy.static import StaticController

SIZED = "sized"  # the arm of the cost model's per-step sizing
PLAIN = "plain"  # the arm of plain decoding
# fixed budgets beside the sizing, tried in this order before any is judged (where the profile
# measured no arm rates): the best fixed trees
# measured on this project's pairs sit at 1-4 nodes (offloaded, sampled) and 3-6 (greedy, eager,
# batches); plain decoding last. Each arm costs the steps that measure it, but a larger budget's
# steps tell the smaller ones' tokens (`fewer_nodes`), so a smaller budget needs only a step of its
# own (to time it) before it is judged
FIXED_ARMS = (4, 2, 1, 6, 3)
# a request's first steps, decided but not judged (see `observe`)
SETTLE_STEPS = 4


class _Pending(NamedTuple):
    """A judged step's evidence for the bandit, held until its whole cost is known."""

    key: RegimeKey
    arm: str
    tokens: float
    credits: dict[str, float]
    reference: float | None
    started: float  # perf_counter() seconds at the step's start
    ms: float  # what it cost until its `observe` returned (charged where no step follows)


def charged_ms(started: float, own_ms: float, next_started: float | None) -> float:
    """What a step that began at `started` (perf_counter() seconds) is charged: until the next step's
    start, else (no step follows it) `own_ms`, what it cost by its own clock; never less than that."""
    return own_ms if next_started is None else max((next_started - started) * 1000, own_ms)


def measured_priors(sizing: MoeAwareController,
                    field: Literal["rates", "tokens"] = "rates") -> dict[RegimeKey, dict[str, float]]:
    """The arms' rates the profile measured (`field="tokens"`: their tokens a row made a step), per
    regime (`moe_spec.profile.arm_rates`): those measured resident for a resident target, those
    measured offloaded for an offloaded one (misses reorder the arms; the profile's one cache size
    stands for any)."""
    offloaded = sizing.residency is not None
    return {RegimeKey.of(entry.sampling, entry.rows): dict(getattr(entry, field)) for entry in sizing.profile.arm_rates
            if (entry.resident_experts is not None) == offloaded}


class BoundedController:
    """A `MoeAwareController` (built with its gate off) and fixed budgets, chosen per step by a
    `BudgetBandit` (where no `bandit` is given, `adjust`: its arms judged at the run's difficulty;
    `tilt`: its prior's scale tilted by the arms' tokens a step, where the profile kept them; measured
    live and not the default, docs/measurements.md); see the module docstring. `decisions` counts
    the steps each arm decided."""

    def __init__(self, sizing: MoeAwareController, fixed: tuple[int, ...] = FIXED_ARMS,
                 bandit: BudgetBandit | None = None, adjust: bool = True, tilt: bool = False,
                 request_prior_steps: float | None = None):
        if sizing.settings.gate:
            raise ValueError("the sizing's own gate must be off: the bandit's plain arm decides plain steps")
        self.sizing = sizing
        self.name = sizing.name
        profile = lambda: sizing.profile  # noqa: E731
        trees = {f"static:{n}": StaticController(EAGLE2_BUDGET.with_nodes(n), sizing.scheme, profile) for n in fixed}
        chains = {f"chain:{n}": StaticController(TreeBudget(n, n, 1), sizing.scheme, profile) for n in fixed}
        self._shapes = {False: trees, True: chains}  # sampled candidates -> the fixed budgets' methods
        self._static = trees  # the request's, set by `begin`
        self.bandit = bandit or BudgetBandit((SIZED, *trees, *chains, PLAIN), priors=measured_priors(sizing),
                                             adjust=adjust,
                                             prior_tokens=measured_priors(sizing, "tokens") if tilt else None)
        unknown = set(self.bandit.arms) - {SIZED, PLAIN, *trees, *chains}
        if unknown:
            raise ValueError(f"the bandit's arms {sorted(unknown)} are none of {SIZED!r}, {PLAIN!r} or the fixed budgets")
        self._budgets: dict[str, TreeBudget] = {**{name: static.budget for name, static in trees.items()},
                                                PLAIN: NO_DRAFT}  # until `begin` gives them the request's scheme
        self._sampling: SamplingConfig = GREEDY
        self._rows = 1
        self._arm = SIZED  # the arm whose budget drafted the step now being planned
        self._next_arm = SIZED
        self._steps = 0  # steps of the request decoding now
        self.decisions: Counter = Counter()  # arm -> steps it decided, over the controller's life
        self.settle_steps = SETTLE_STEPS
        self._pending: _Pending | None = None  # the last judged step, until the next one starts
        # the request's difficulty, which the arms are judged at (None: the run's)
        self._difficulty = RequestDifficulty(request_prior_steps) if request_prior_steps else None

    def begin(self, default: TreeBudget, sampling: SamplingConfig = GREEDY) -> TreeBudget:
        self._settle()  # the last request's last step: no step of it follows
        self._sampling = sampling
        self._rows = 1
        self._steps = 0
        if self._difficulty is not None:
            self._difficulty.reset()
        sized = self.sizing.begin(default, sampling)
        # every fixed budget resolves the request's candidate scheme alike: one of them tells it
        sampled = next(iter(self._shapes[False].values())).begin(default, sampling).sampled
        self._static = self._shapes[sampled]
        budgets = {name: static.begin(default, sampling) for name, static in self._static.items()}
        self._budgets = {**budgets, PLAIN: NO_DRAFT}
        self._arm = self._choose()
        return sized if self._arm == SIZED else self._budgets[self._arm]

    def plan(self, candidates: StepForest, draft_ms: float) -> StepPlan:
        candidates = StepForest.of(candidates)
        self._rows = candidates.rows
        arm = self._arm
        if arm == SIZED:
            planned = self.sizing.plan(candidates, draft_ms)
            verify = planned.verify
        elif arm == PLAIN or not candidates.num_drafted:
            verify = candidates
        else:
            verify = self._static[arm].plan(candidates, draft_ms).verify
        # in flight: this step (recorded once the step after it starts) and the one before, if judged
        self._next_arm = self._choose((arm, *((self._pending.arm,) if self._pending is not None else ())))
        expected = planned.expected_experts if arm == SIZED else self.sizing.expected_experts(verify)
        return StepPlan(verify, self._budget_of(self._next_arm), expected_experts=expected)

    def observe(self, record: StepRecord) -> None:
        entered = time.perf_counter()
        if record.started is not None:
            self._settle(record.started)
        # the sizing learns from its own steps and from plain ones (a plain pass's prediction is
        # cached): the machine's speed and acceptance per depth stay current for when it decides
        self.sizing.observe(record, learn=self._arm in (SIZED, PLAIN))
        self._steps += 1
        self.decisions[self._arm] += 1
        # a request's first steps pay its cold start whichever arm decides them (offloaded experts
        # not yet resident, a short prefix): judged, they made the arm that happened to open each
        # request look worst and the choice rotate among the fixed budgets
        settled = self._steps > self.settle_steps
        if settled or self._difficulty is not None:
            tokens, credits, reference = self._told(record)
            if self._difficulty is not None and reference is not None:
                self._difficulty.add(reference)  # a settling step tells the request's difficulty too
        if settled:
            key = self._key(record.verified.rows)
            if record.started is None:  # an untimed step (a loop other than the engine's): its own time
                self.bandit.record(key, self._arm, tokens, record.step_ms, credits=credits, reference=reference)
            else:
                ms = record.step_ms + (time.perf_counter() - entered) * 1000
                self._pending = _Pending(key, self._arm, tokens, credits, reference, record.started, ms)
        self._arm = self._next_arm

    def _settle(self, next_started: float | None = None) -> None:
        """Record the pending step, charged until `next_started` (perf_counter() seconds: the next
        step's start), or, where no step follows, what it cost until its `observe` returned."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        self.bandit.record(pending.key, pending.arm, pending.tokens, charged_ms(pending.started, pending.ms, next_started),
                           credits=pending.credits, reference=pending.reference)

    def _told(self, record: StepRecord) -> tuple[float, dict[str, float], float | None]:
        """The step's tokens, on average given its drafts (`fewer_nodes`; else as the sizing counts
        them), what other arms would have made on it, where the record tells it (plain decoding
        one token a row; after a fixed budget's step, every smaller fixed budget's tokens), and the
        step's reference for the bandit: the tokens its best-scored drafted node alone makes on
        average, which every arm that drafts tells alike (None for a plain step, a row without
        drafts, or sampled siblings)."""
        # a sized chain tells the shorter chains' tokens too, but only on the steps the sizing found
        # promising enough to draft that far: credited, they would judge those chains on their best steps
        played = self._static[self._arm].budget.max_nodes if self._arm in self._static else 0
        smaller = {name: static.budget.max_nodes for name, static in self._static.items()
                   if static.budget.max_nodes < played}
        drafted = min(tree.num_drafted for tree in record.verified)
        wanted = (*smaller.values(), *(() if record.sampling.greedy else (None,)), *((1,) if drafted else ()))
        told = tokens_by_budget(record, wanted)
        tokens = float(record.tokens_produced) if record.sampling.greedy else told.get(None)
        if tokens is None:
            tokens = self.sizing.tokens_expected(record)
        credits = {PLAIN: float(record.batch)}
        credits.update({name: told[nodes] for name, nodes in smaller.items() if nodes in told})
        return tokens, credits, told.get(1) if drafted else None

    @property
    def allowed_arms(self) -> tuple[str, ...]:
        """The arms that may decide the request begun last: the sizing, the fixed budgets in the
        shape of its candidates, plain decoding."""
        return (SIZED, *self._static, PLAIN)

    def _choose(self, in_flight: tuple[str, ...] = ()) -> str:
        return self.bandit.choose(self._key(self._rows), allowed=self.allowed_arms, in_flight=in_flight,
                                  difficulty=self._difficulty)

    def _key(self, rows: int) -> RegimeKey:
        return RegimeKey.of(self._sampling, rows)

    def _budget_of(self, arm: str) -> TreeBudget:
        if arm == SIZED:
            return self.sizing.next_budget(self._rows)
        return self._budgets[arm]
