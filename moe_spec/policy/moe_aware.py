"""`MoeAwareController`: moe_spec's policy (the `moe-aware` method and its `-noexperts` ablation)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from moe_spec.core.control import StepPlan
from moe_spec.core.drafting import EAGLE2_BUDGET, NO_DRAFT, TreeBudget
from moe_spec.core.forest import StepForest
from moe_spec.core.sampling import GREEDY, SamplingConfig
from moe_spec.core.step_record import StepRecord
from moe_spec.policy.candidate_scheme import CandidateScheme, drawn
from moe_spec.policy.chain_sizing import ChainAcceptance, best_chain_length
from moe_spec.policy.draft_pricing import DepthPricer
from moe_spec.policy.online_correction import DraftCostTracker
from moe_spec.policy.profile_prices import ProfilePrices
from moe_spec.policy.profiled import ProfiledController
from moe_spec.policy.selection import StepPrices, grow_forest
from moe_spec.policy.speculation_gate import SpeculationGate
from moe_spec.profile.cost_model import expected_unique_experts


@dataclass(frozen=True)
class MoeAwareSettings:
    """What a `MoeAwareController` is built with (its ablations among them), fixed for its life."""

    price_experts: bool = True  # nodes priced by the experts they newly load (False: `-noexperts`)
    gate: bool = True  # pause drafting where speculation measures (in a replay: is modelled) below plain
    price_residency: bool = True  # offloaded: non-resident experts priced as fetches
    candidate_growth: float = 1.25  # the next candidate tree: this many times the recent sized choices' nodes
    candidate_min: int = 4  # ... and at least this many
    sampled_min: int = 2  # depth of a sampled candidate chain, when drafting at all
    recent_steps: int = 4  # sized choices the next candidate tree is sized from
    probe_every: int = 4  # while the gate pauses drafting, every this many steps drafts anyway
    price_depths: bool = True  # drafting stops where no deeper node could pay (`DepthPricer`)
    expect_tokens: bool = True  # a sampled chain counts its expected tokens (`tokens_expected`)
    # offloaded: what reads cost a pass learnt online apart from the compute (`CostCorrection.fetch_scale`;
    # False: the profile's fetch price, the ablation `-profilefetch`)
    learn_fetch: bool = True

    def __post_init__(self):
        for name in ("candidate_min", "sampled_min", "recent_steps", "probe_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.candidate_growth > 0:
            raise ValueError(f"candidate_growth must be > 0, got {self.candidate_growth}")


class _Choice(NamedTuple):
    """One step's sized choice (`ForestGrowth.sized_shape`), what the next candidate tree is sized from."""

    nodes: int  # most chosen nodes in one row (0: none, or a plain step)
    depth: int  # the deepest chosen node's depth
    edge: bool  # it reached the candidates' last level, or took every drafted node


class _VerifyPlan(NamedTuple):
    """What a plan knew of the pass it asked for (`MoeAwareController._planned`)."""

    nodes: int  # real nodes verified, roots included
    rows: int
    probs: object  # [L, N, E] torch predicted routing of the verified nodes, or None (dense or not priced)
    calibrated: tuple[float, ...] | None  # [N] calibrated P(on accepted path) of the verified nodes
    predicted_ms: float | None  # the pass's compute time under the profile's prices, None: not known


class MoeAwareController(ProfiledController):
    """moe_spec's policy: best-first subtree over the whole candidate tree, each node priced by
    the experts it newly activates (see `selection.py`); no speculation when that wins.

    Each step makes two choices from one best-first growth (`selection.grow_forest`): the size of
    the next candidate tree, from the set of best throughput with its drafting priced by the depth
    it needs (`draft_costs`, measured online: a fixed part and a part per head forward), and what to
    verify of the candidates already drafted, whose drafting is spent: every node whose value pays
    for its own verify time at that set's rate. The drafter expands `candidate_growth` times as many
    nodes per row as recent sized choices, and at least one more (at least `candidate_min`; starting from 8 nodes, 3 deep),
    as deep as they went, and one level deeper when a recent choice used the candidates' last level
    (so deeper trees are explored where they might pay, and no level is drafted every step only to
    be dropped). Within a step the drafter of top candidates stops a row's next depth where no node
    there could pay at the last growth's prices (`DepthPricer`, `price_depths`). Sampled candidates,
    verified whole, are chains of the length of best throughput under the per-depth acceptance
    chains are measured to reach (`chain_sizing`, `_sized_sampled`), their experts priced by the
    profile's unique-experts curve.

    The profile's verify prices (`ProfilePrices`) are scaled online by the measured speed of the
    machine (`CostCorrection`). With `gate` (`moe-aware-unbounded`; `moe-aware` bounds the sizing
    by a bandit instead), drafting pauses where speculation measures below plain decoding
    (`SpeculationGate`; a sampled chain's tokens counted as expected from its exact acceptance
    probabilities, `tokens_expected`); without online measurements (`adapt=False`, a replay) the
    model's verdict pauses it instead, after `recent_steps` sized choices of no node.

    With the experts offloaded, `residency` (a callable returning the cache's [L, E] resident
    experts, read at decision time) lets selection price each node's non-resident experts as
    fetches under the profile's fetch cost, scaled by what reads measure to cost the run
    (`CostCorrection.fetch_scale`; `learn_fetch=False`: the profile's price, the ablation);
    `price_residency=False` is the ablation that prices compute only (its online cost scale still
    learns the average fetch time).
    """

    name = "moe-aware"

    def __init__(self, profile, price_experts: bool = True, adapt: bool = True, persist: bool = False,
                 recent_steps: int = 4, probe_every: int = 4, candidate_growth: float = 1.25, candidate_min: int = 4,
                 scheme: CandidateScheme = CandidateScheme.AUTO, residency=None, price_residency: bool = True,
                 gate: bool = True, price_depths: bool = True, expect_tokens: bool = True, learn_fetch: bool = True):
        super().__init__(profile, adapt=adapt, persist=persist, scheme=scheme)
        self.settings = MoeAwareSettings(price_experts=price_experts, gate=gate, price_residency=price_residency,
                                         candidate_growth=candidate_growth, candidate_min=candidate_min,
                                         recent_steps=recent_steps, probe_every=probe_every,
                                         price_depths=price_depths, expect_tokens=expect_tokens,
                                         learn_fetch=learn_fetch)
        self.residency = residency  # () -> [L, E] bool, or None: experts not offloaded
        self._default = EAGLE2_BUDGET
        self._asked = EAGLE2_BUDGET  # the candidate tree last asked for
        self._verify_plan: _VerifyPlan | None = None  # what the last plan knew of the nodes it verifies
        self._rows = 1  # rows of the batch decoding now (from the last plan)
        self.prices = ProfilePrices(profile, price_experts)  # the profile's own prices, cached per shape
        self.speculation_gate = SpeculationGate(probe_every)  # used only with `settings.gate`
        self._chain: ChainAcceptance | None = None  # sampled chains' acceptance per depth, when the profile measured it
        self._fresh_history()

    def _fresh_history(self) -> None:
        self.speculation_gate.forget()
        self._recent: deque[_Choice] = deque(maxlen=self.settings.recent_steps)  # the last sized choices
        self.draft_costs = DraftCostTracker()
        self._depth_prices: tuple[float, float] | None = None  # (rate, cheapest node ms) of the last growth, for `DepthPricer`

    def begin(self, default: TreeBudget, sampling: SamplingConfig = GREEDY) -> TreeBudget:
        super().begin(default, sampling)
        self._rows = 1  # until the first plan shows the batch
        if not self.persist:
            self._fresh_history()
        self._default = default
        prior = self.profile.chain_conditional_for(sampling) if self.sampled else ()
        if not prior:
            self._chain = None
        elif self._chain is None or not self.persist or self._chain.prior != prior:
            self._chain = ChainAcceptance(prior)
        return self._next_budget()

    def plan(self, candidates: StepForest, draft_ms: float) -> StepPlan:
        candidates = StepForest.of(candidates)
        self._rows = candidates.rows
        if candidates.num_drafted == 0:  # drafting was skipped: a plain step
            self._recent.append(_Choice(0, 0, False))
            self._verify_plan = None
            return StepPlan(candidates, self._next_budget())
        if self._chain is not None and drawn(candidates):  # sized from measured acceptance: nothing to grow
            self.draft_costs.update(self._forwards_run(candidates), draft_ms)
            length = candidates.max_depth
            self._recent.append(_Choice(length, length, False))
            self.speculation_gate.drafted()
            predicted = self._chain_verify_ms(length, candidates.rows, scaled=False) if self._prices_expected_experts() else None
            return self._planned(candidates, None, None, predicted)
        # a sampled tree is verified whole and its plan sizes the next one only, whose tokens are not
        # drawn yet: priced by the experts a tree of its size loads on average, not by routing predicted
        expected = drawn(candidates) and self._prices_expected_experts()
        routed = self.settings.price_experts and not expected
        # without fetches priced (the common case): the routing as id sets, no one-hot
        sets = self._expert_sets(candidates) if routed and not self._prices_fetches() else None
        probs = self._expert_probs(candidates) if routed and sets is None else None
        sizes = [len(tree) for tree in candidates.trees]
        row_probs = probs.split(sizes, dim=1) if probs is not None else [None] * candidates.rows
        row_sets = sets.split(sizes) if sets is not None else [None] * candidates.rows
        prices = [StepPrices(values, p, s) for values, p, s in zip(self._value_rows(candidates), row_probs, row_sets)]  # p: [L, N_b, E]
        self.draft_costs.update(self._forwards_run(candidates), draft_ms)
        fixed_ms, depth_ms = self._draft_prices()
        residency = self.residency() if probs is not None and self._prices_fetches() else None  # [L, E] bool, exact now
        cost = self.cost_model()
        growth_cost = self.prices.with_expected_experts(cost, candidates.num_drafted) if expected else cost
        # a set d levels deep needs d + 1 head forwards (the last finds nothing better to keep)
        growth = grow_forest(candidates, prices, growth_cost, depth_ms, draft_fixed_ms=fixed_ms + depth_ms,
                             residency=residency)
        nodes, depth = growth.sized_shape()
        if self.settings.price_depths and not drawn(candidates):  # what the next top-candidate tree's `DepthPricer` reads
            self._depth_prices = (growth.best_rate, _cheapest_node_ms(growth, cost))
        full = growth.best_size >= candidates.num_drafted
        self._recent.append(_Choice(nodes, depth, depth >= candidates.max_depth or full))
        if nodes:
            self.speculation_gate.drafted()
        calibrated = self._calibrated(candidates)  # [N] the values `observe` learns acceptance from
        # the growth's price of the verified prefix is the pass's prediction, unless it priced fetches
        # too or no experts at all (the ablation's measured passes are compared with the full model)
        exact = residency is None and (probs is not None or sets is not None or expected or not cost.num_layers)
        if drawn(candidates):  # no cut of a sampled tree is exact: the choice sizes the next one only
            whole = exact and len(growth.order) == candidates.num_drafted  # the growth priced every node
            return self._planned(candidates, probs, calibrated,
                                 self._unscaled(cost, growth.verify_ms[-1], candidates.rows) if whole else None)
        size = growth.verified_size()
        predicted = self._unscaled(cost, growth.verify_ms[size], candidates.rows) if exact else None
        if size == candidates.num_drafted:  # every drafted node pays: nothing to cut
            return self._planned(candidates, probs, calibrated, predicted)
        keep = [sorted(nodes) for nodes in growth.rows_of(size)]  # in the subforest's node order (`DraftTree.subtree`)
        flat = [candidates.row_starts[row] + node for row, nodes in enumerate(keep) for node in nodes]
        return self._planned(candidates.subforest(keep), probs[:, flat] if probs is not None else None,
                             tuple(calibrated[node] for node in flat), predicted)

    def _planned(self, verify: StepForest, probs, calibrated, predicted_ms: float | None = None) -> StepPlan:
        """The plan, remembering for `observe` what it knew of the verified nodes: their predicted
        routing ([L, N_v, E], or None), their calibrated values [N_v] and the pass's predicted
        compute time under the profile's prices (None: not known), so that observe prices and
        learns from the pass it measures without predicting either again."""
        self._verify_plan = _VerifyPlan(verify.num_nodes, verify.rows, probs, calibrated, predicted_ms)
        expected = (lambda: _likely_experts(probs)) if probs is not None and self._prices_fetches() else None
        return StepPlan(verify, self._next_budget(), expected_experts=expected)

    def expected_experts(self, verify: StepForest):
        """() -> [L] the experts each layer is expected to need to verify `verify`, for a pass planned
        by someone else (`BoundedController`'s fixed arms), computed when called; None unless the
        experts are offloaded and priced by residency (the only case where reading them ahead can pay)."""
        if not self._prices_fetches() or not self.profile.cost_model.num_layers:
            return None
        return lambda: _likely_experts(self._expert_probs(StepForest.of(verify)))  # [L, N, E] routing

    def _unscaled(self, cost, scaled_ms: float, rows: int) -> float:
        """A verify time of a pass of `rows` rows predicted under the scaled prices `cost`, under the
        profile's own (the fixed part swapped, the rest divided by the scale)."""
        base = self.profile.cost_model
        if cost is base:
            return scaled_ms
        scale = self.cost_correction.scale
        return (scaled_ms - cost.fixed_ms(rows)) / scale + base.fixed_ms(rows)

    def observe(self, record: StepRecord, learn: bool = True) -> None:
        """What the step did; `learn=False`: a step someone else planned (`BoundedController`'s
        fixed arms) is not learnt from, since predicting its pass and its nodes' values afresh cost
        more than a fixed tree's whole plan (0.9-1.2% of an offloaded step against 0.1%)."""
        if not learn:
            self._verify_plan = None
            return
        # the whole step as the controller can measure it: a speculative step's acceptance and cache
        # moves cost more than a plain one's (a batch's several ms a step)
        self.speculation_gate.observe(record.verified.rows, record.speculated, self.tokens_expected(record),
                                      record.step_ms)
        plan, self._verify_plan = self._verify_plan, None
        if plan is not None and (plan.nodes, plan.rows) != (record.verified.num_nodes, record.verified.rows):
            plan = None  # not this pass's plan
        if self.adapt:  # plain passes measure the machine's speed too
            compute_ms = self._predicted_compute_ms(record.verified, plan)
            fetch_ms = 0.0
            fetch = self.profile.cost_model.fetch
            if record.fetch is not None and fetch is not None and self._prices_fetches():  # the profile's price
                fetch_ms = fetch.total_ms(record.fetch.per_layer_misses, record.routing.unique_per_layer())
            if self.settings.learn_fetch:
                self.cost_correction.update(compute_ms, record.verify_ms, rows=record.verified.rows, fetch_ms=fetch_ms)
            else:  # reads at the profile's price: the speed learnt from what the pass measured beyond them
                self.cost_correction.update(compute_ms, record.verify_ms - fetch_ms, rows=record.verified.rows)
        if self.adapt and record.speculated:
            if self._chain is not None and drawn(record.verified):
                self._chain.observe(_chain_trials(record))
            else:
                self._learn_acceptance(record, plan.calibrated if plan is not None else None)

    def tokens_expected(self, record: StepRecord) -> float:
        """The tokens the step makes on average given what it drew, for the gate's measured rate: a
        sampled chain's 1 + sum_d a_1 ... a_d from the verification's own exact acceptance
        probabilities (`Acceptance.trials`, up to the first rejected node; deeper nodes at the
        per-depth acceptance chains reach, `ChainAcceptance`), where the tokens it made add the
        luck of each acceptance draw. Top candidates, greedy steps and trees with siblings: the
        tokens made."""
        if self._chain is None or not self.settings.expect_tokens or not drawn(record.verified):
            return float(record.tokens_produced)
        total = 0.0
        for tree, acceptance in zip(record.verified, record.acceptances):
            if tree.num_drafted != int(tree.depths.max()):  # siblings: not a chain
                total += acceptance.num_accepted + 1
                continue
            tried = dict(acceptance.trials)  # node -> P(accepted | parent reached); a chain's node d sits at depth d
            reach, tokens = 1.0, 1.0
            for depth in range(1, tree.num_drafted + 1):
                reach *= tried[depth] if depth in tried else self._chain.conditional(depth)
                tokens += reach
            total += tokens
        return total

    def _predicted_compute_ms(self, verified: StepForest, plan: "_VerifyPlan | None") -> float:
        """The profile's (unscaled) compute time of a verified pass: the plan's prediction, or from
        the routing the plan predicted for it, a one-row plain pass from the cached plain prediction
        (one token loads exactly K experts per layer), else predicted afresh."""
        if plan is not None and plan.predicted_ms is not None:
            return plan.predicted_ms
        if plan is not None and plan.probs is not None:
            cost = self.profile.cost_model
            return cost.predict_ms(verified.pass_tokens, expected_unique_experts(plan.probs), rows=verified.rows)
        if verified.rows == 1 and verified.num_nodes == 1:
            return self._plain_profiled()
        return self.predicted_verify_ms(verified)

    def _forwards_run(self, candidates: StepForest) -> int:
        """Head forwards past the root pair's that drafting these candidates took: EAGLE-2's growth
        expands one level past the deepest kept node to find nothing there beats what it keeps
        (unless the budget's depth stopped it, or one node was all it could keep)."""
        budget = self._asked
        if budget.pricer is not None and budget.pricer.forwards:  # counted as they ran
            return budget.pricer.forwards
        depth = candidates.max_depth
        return depth + (depth < budget.max_depth and budget.max_nodes > 1)

    def _plain_profiled(self) -> float:
        """The profile's one-row plain step."""
        return self.prices.plain_pass_ms(1)

    def _plain_ms(self) -> float:
        """A one-row plain step's predicted time (the profile's, at the speed measured since)."""
        return self._plain_profiled() * (self.cost_correction.scale if self.adapt else 1.0)

    def _plain_rate(self) -> float:
        """Tokens per ms of a plain step of the batch now decoding (the profile's prediction at the
        speed measured since): what the gate compares speculation with before a plain step has been
        measured. B rows make B tokens a pass, whose B roots load about E (1 - (1 - K/E)^B) experts
        per layer (distinct rows route like unrelated tokens)."""
        rows = self._rows
        if rows == 1:
            ms = self._plain_ms()
        else:
            ms = self.prices.plain_pass_ms(rows)
            if self.adapt:
                ms = ms * self.cost_correction.scale + self.cost_correction.offset_ms(rows)
        return rows / ms

    def _prices_expected_experts(self) -> bool:
        """Sampled one-row trees are priced by the profile's unique-experts curve (`ProfilePrices.with_expected_experts`)."""
        return (self.settings.price_experts and self._rows == 1 and not self._prices_fetches()
                and self.profile.unique_experts_curve is not None and bool(self.profile.cost_model.num_layers))

    def _prices_fetches(self) -> bool:
        return self.settings.price_experts and self.settings.price_residency and self.residency is not None

    def next_budget(self, rows: int) -> TreeBudget:
        """The candidate tree to draft next for a batch of `rows` rows, asked by a caller that
        planned the last steps itself (`BoundedController`)."""
        self._rows = rows
        return self._next_budget()

    def _next_budget(self) -> TreeBudget:
        """The candidate tree to draft next, from the recent choices and measured rates."""
        self._asked = self._budget_after()
        return self._asked

    def _budget_after(self) -> TreeBudget:
        default = self._default
        # without online measurements (a replay) the model's verdict pauses drafting; with them, the
        # measured rates do: the model's zero-node choices over a few steps of bad luck paused
        # drafting where speculation was measured to pay (1.35x ar against 1.41x, shipped set)
        chose_plain = len(self._recent) == self.settings.recent_steps and all(choice.nodes == 0 for choice in self._recent)
        if self.settings.gate and self.speculation_gate.pauses(self._plain_rate if self.adapt else None, chose_plain):
            return NO_DRAFT  # speculation has not paid lately: skip drafting
        if self.sampled:
            return self._sized_sampled(default)
        if len(self._recent) < self.settings.recent_steps:
            return self._sized(default, 8, 3)
        nodes = max(choice.nodes for choice in self._recent)
        depth = max(choice.depth for choice in self._recent)
        deeper = any(choice.edge for choice in self._recent)  # a recent choice used the candidates' last level
        return self._sized(default, nodes, depth, deeper)

    def _sized_sampled(self, default: TreeBudget) -> TreeBudget:
        """The next sampled candidate tree: a chain (one draw per node), of the length of best
        throughput under the acceptance chains are measured to reach per depth (`chain_sizing`), or,
        with a profile that measured none, `_sized_by_last_chain`. Without online measurements (a
        replay) a length of 0 skips drafting; with them the measured gate decides, and the chain is
        at least one node long."""
        if self._chain is None:
            return self._sized_by_last_chain(default)
        longest = min(default.max_depth, default.max_nodes)
        fixed_ms, depth_ms = self._chain_draft_prices()
        rows = self._rows

        def step_ms(length: int) -> float:
            return (fixed_ms + depth_ms * length if length else 0.0) + self._chain_verify_ms(length, rows)

        length, _ = best_chain_length(self._chain.reach(longest), step_ms, rows)
        if not length and not self.adapt:
            return NO_DRAFT
        length = max(length, 1)
        return TreeBudget(length, length, 1, sampled=True)

    def _chain_draft_prices(self) -> tuple[float, float]:
        """(fixed ms, ms per node) of drafting a chain: measured (`DraftCostTracker`, a chain of L
        nodes counted as L head forwards), else the profile's draft formula at the speed measured."""
        if self.draft_costs.samples:
            return self._draft_prices()
        base, per_depth = self._profiled_draft()
        scale = self._machine_scale()
        return max(base, 0.0) * scale, max(per_depth, 0.0) * scale

    def _draft_prices(self) -> tuple[float, float]:
        """(fixed ms, ms per head forward) of drafting, measured (`DraftCostTracker`), its slope
        shrunk towards the profile's at the speed measured."""
        per_depth = self._profiled_draft()[1]
        return self.draft_costs.estimate(per_depth * self._machine_scale() if per_depth > 0 else None)

    def _profiled_draft(self) -> tuple[float, float]:
        """(base ms, ms per depth) of the profile's draft formula ((0, 0): it has none)."""
        cost = self.profile.draft_cost
        return cost.base_ms, cost.per_depth_ms

    def _machine_scale(self) -> float:
        """How much slower than profiled this machine runs now (the verify cost correction's scale)."""
        return self.cost_correction.scale if self.adapt else 1.0

    def _chain_verify_ms(self, length: int, rows: int, scaled: bool = True) -> float:
        """Verify time of `rows` chains of `length` nodes and their roots (`ProfilePrices`), at the
        speed measured (`scaled`, as `cost_model()` scales it) or the profile's."""
        ms = self.prices.chain_verify_ms(length, rows)
        if not (scaled and self.adapt):
            return ms
        return ms * self.cost_correction.scale + self.cost_correction.offset_ms(rows)

    def _sized_by_last_chain(self, default: TreeBudget) -> TreeBudget:
        """The next sampled candidate tree: a chain (one draw per node), verified whole, so drafted
        at the depth last chosen (no overshoot to cut), one level deeper only where that choice took
        the whole chain (the candidates bounded it, not the prices); `sampled_min` deep to start with
        or after a plain step. A chain, not EAGLE-2's wide-then-narrow shape: a later sibling is
        drawn from the same q once the first draw is rejected, and accepts little, while a deeper
        node is drawn from the accepted draw's own q (T = 1, 16 shipped prompts, interleaved: chains
        of 3 and 4 nodes 1.33x ar, static:2 1.26x, static:3@sampled with siblings 1.20x; T = 0.7
        top-p 0.9: chain of 3 1.48x, static:2 1.27x, static:4@sampled 1.24x)."""
        last = self._recent[-1] if self._recent else None
        depth = last.depth + last.edge if last is not None and last.nodes else self.settings.sampled_min
        depth = min(default.max_depth, default.max_nodes, max(self.settings.sampled_min, depth))
        return TreeBudget(depth, depth, 1, sampled=True, node_features=self.wants_node_features)

    def _sized(self, default: TreeBudget, nodes: int, depth: int, deeper: bool = True) -> TreeBudget:
        """A candidate tree of top tokens around `nodes` chosen nodes per row `depth` deep:
        `candidate_growth` times the nodes (at least `candidate_min`), one level deeper if `deeper`,
        and only as many expansions per level as that many nodes can use (each expansion is a row of
        the head's forward and of its output projection)."""
        nodes = min(default.max_nodes, max(self.settings.candidate_min, round(self.settings.candidate_growth * nodes)))
        depth = min(default.max_depth, max(depth + deeper, 1))
        return TreeBudget(nodes, depth, min(default.branching, max(2, -(-nodes // depth))), sampled=False,
                          node_features=self.wants_node_features, pricer=self._depth_pricer())

    def _depth_pricer(self) -> DepthPricer | None:
        """The next candidate tree's `DepthPricer`, at the last growth's rate and cheapest node and the
        measured per-depth draft time; None before any growth or measured draft, or when not pricing
        depths."""
        if not self.settings.price_depths or self._depth_prices is None:
            return None
        rate, node_ms = self._depth_prices
        depth_ms = self._draft_prices()[1]
        if rate <= 0 or depth_ms <= 0:
            return None
        factor = self.acceptance_correction.factor if self.adapt else (lambda depth: 1.0)
        return DepthPricer(self.calibration, factor, rate, node_ms, depth_ms)


def _chain_trials(record: StepRecord) -> list[tuple[int, float]]:
    """(depth, P(accepted | parent reached)) of each verified chain node whose parent was reached,
    every row's, from the verification's own trials (first children only: a later sibling's trial
    is conditional on its elder's rejection too)."""
    out = []
    for tree, acceptance in zip(record.verified, record.acceptances):
        depths, ranks = tree.depth_list, tree.rank_list
        out += [(depths[node], probability) for node, probability in acceptance.trials if ranks[node] == 0]
    return out


# an expert is read ahead when the plan expects at least this many of the pass's nodes to use it:
# reading every predicted expert (a 0/1 set per node) read 23 experts a token ahead of which 57%
# were used, each wrong one also evicting a resident expert (embedded pair, C = 16 of 64)
MIN_NODES = 2.0


def _likely_experts(probs) -> tuple[tuple[int, ...], ...]:
    """[L] the experts each layer is expected to load for at least `MIN_NODES` nodes: the summed
    predicted routing probs [L, N, E] over the nodes."""
    used = probs.double().sum(dim=1)  # [L, E] expected nodes per expert
    return tuple(tuple(row.nonzero().flatten().tolist()) for row in used >= MIN_NODES)


def _cheapest_node_ms(growth, cost) -> float:
    """The least verify time any node added to the growth cost (its token and new experts; the
    per-token price when it added none): what `DepthPricer` charges a deeper node at least."""
    verify = growth.verify_ms
    return min((b - a for a, b in zip(verify, verify[1:])), default=cost.per_token_ms)
