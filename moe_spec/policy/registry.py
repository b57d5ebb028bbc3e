"""The decoding methods, by name: the one registry behind `bench`, `simulate`, `demo`,
`generate --method` and the transformers drop-in (`speculative_generate(method=...)`).

Methods: `ar`, `eagle2` (`EAGLE2_BUDGET`: EAGLE-2's published tree), `static:N` (N nodes with
EAGLE-2's depth and branching), `chain:N` (N nodes, one per depth), `static-best` (the grid `STATIC_GRID` of static budgets, best
throughput in hindsight: an aggregate that `bench` and `simulate` report, not a method one run can
use), `truncate` (EVICT-style cut under a token-count cost), `moe-aware` (ours),
`moe-aware-noexperts` (ours without expert pricing, an ablation) and `moe-aware-noresidency` (with
the experts offloaded: every expert priced by its compute alone, whether resident or not).

A method is what `SpecDecoder` needs besides the target: a drafter (None: plain autoregressive
decoding through the same cache machinery) and a controller (None: the drafter's own default
budget). It is named `name` or `name:arg` (`static:16`), optionally with its candidate scheme for
sampling requests, `@top` or `@sampled` (`eagle2@sampled`; without: `auto`, the scheme the profile
measured to accept more, see `moe_spec.policy.candidate_scheme`). `METHODS` maps a name to a `Policy`:
whether it drafts, what argument it takes, and how its controller is built from a profile (asked
for only by the methods that price nodes) with online corrections on (`adapt=True`, a real run) or
off (`adapt=False`, a replay under another cost model). To add a method, register a `Policy`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from moe_spec.core.control import Controller
from moe_spec.core.drafting import EAGLE2_BUDGET, Drafter, TreeBudget
from moe_spec.core.target import TargetModel
from moe_spec.errors import InputError
from moe_spec.offload.offloaded_experts import reading_label
from moe_spec.policy.candidate_scheme import CandidateScheme
from moe_spec.policy.bounded_controller import BoundedController
from moe_spec.policy.moe_aware import MoeAwareController
from moe_spec.policy.truncate import TruncateController, token_count_cost
from moe_spec.policy.static import StaticController

if TYPE_CHECKING:
    from moe_spec.profile.artifact import Profile

ProfileSource = Callable[[], "Profile"]  # the target's profile, loaded when first called


def _no_argument(base: str, arg: str | None) -> None:
    if arg is not None:
        raise InputError(f"method {base!r} takes no argument, got {base}:{arg}")


def _node_count(base: str, arg: str | None) -> None:
    if arg is None or not arg.isdigit() or int(arg) < 1:
        raise InputError(f"method {base!r} needs a node budget >= 1, e.g. {base}:16 (got {arg!r})")


@dataclass(frozen=True)
class Policy:
    """One registered method."""

    drafts: bool  # needs a drafter (False: plain autoregressive decoding)
    # (arg, profile, adapt, candidate scheme, residency) -> controller; residency: () -> [L, E] bool
    # resident experts when the target's experts are offloaded, else None
    build: Callable[..., Controller | None]
    check_argument: Callable[[str, str | None], None] = _no_argument  # (base name, arg); raises InputError


def _truncate(arg: str | None, profile: ProfileSource, adapt: bool, scheme: CandidateScheme, residency=None) -> Controller:
    profiled = profile()
    try:
        token_cost = token_count_cost(profiled)
    except ValueError as error:
        raise InputError(f"method 'truncate' needs the profile's unique-experts curve: {error}") from None
    return TruncateController(profiled, token_cost, adapt=adapt, budget=EAGLE2_BUDGET, scheme=scheme)


def _static(budget: TreeBudget, profile: ProfileSource, scheme: CandidateScheme) -> Controller:
    return StaticController(budget, scheme, profile)


REQUEST_PRIOR_STEPS = 16.0  # the run's difficulty weighs as this many of the request's steps


def moe_aware_builder(price_experts: bool = True, price_residency: bool = True, bounded: bool = True,
               adjust: bool = True, tilt: bool = False, request_prior_steps: float | None = None,
               price_overflow: bool = True, learn_fetch: bool = True):
    """The controller of `moe-aware` and its ablations: the cost model's sizing, bounded by fixed
    budgets (`BoundedController`) in a real run; alone, with its own gate, in a replay (no
    measured throughput to choose by) or unbounded (`bounded=False`); `adjust=False`: the bound's
    bandit judges each arm on the steps it was told, not at the run's difficulty; `tilt=True`: its
    prior's scale tilts with the arms' tokens a step; `price_overflow=False`: offloaded, the experts
    beyond the resident slots are priced as plain misses (`FetchCost.overflow_ms` left out);
    `learn_fetch=False`: offloaded, reads priced at the profile's fetch cost, not at what the run
    measures them to cost (`CostCorrection.fetch_scale`)."""
    def build(arg, profile: ProfileSource, adapt: bool, scheme: CandidateScheme, residency=None) -> Controller:
        bound = bounded and adapt
        if not price_overflow:
            profile = _without_overflow(profile)
        # bounded, the sizing keeps what it learnt across requests, as the bandit does: it decides
        # few steps of each, and started afresh each time it was judged by its warm-up trees
        sizing = MoeAwareController(profile(), price_experts=price_experts, adapt=adapt, scheme=scheme,
                                    residency=residency, price_residency=price_residency, gate=not bound,
                                    persist=bound, learn_fetch=learn_fetch)
        return BoundedController(sizing, adjust=adjust, tilt=tilt,
                                 request_prior_steps=request_prior_steps) if bound else sizing
    return build


def _without_overflow(profile: ProfileSource) -> ProfileSource:
    """`profile` whose fetch cost prices no experts beyond the resident slots (`moe-aware-nooverflow`)."""
    def source():
        loaded = profile()
        fetch = loaded.cost_model.fetch
        return loaded if fetch is None else replace(loaded, cost_model=replace(loaded.cost_model,
                                                                               fetch=replace(fetch, overflow_ms=0.0)))
    return source


METHODS: dict[str, Policy] = {
    "ar": Policy(False, lambda arg, profile, adapt, scheme, residency=None: None),
    "eagle2": Policy(True, lambda arg, profile, adapt, scheme, residency=None: _static(EAGLE2_BUDGET, profile, scheme)),
    "static": Policy(True, lambda arg, profile, adapt, scheme, residency=None: _static(
        EAGLE2_BUDGET.with_nodes(int(arg)), profile, scheme), _node_count),
    # N nodes in a chain (one candidate per depth): the fixed shape sampled candidates pay most with
    "chain": Policy(True, lambda arg, profile, adapt, scheme, residency=None: _static(
        TreeBudget(int(arg), int(arg), 1), profile, scheme), _node_count),
    "truncate": Policy(True, _truncate),
    "moe-aware": Policy(True, moe_aware_builder()),
    # the ablations: calibrated values and token cost only, no expert pricing; with offloaded experts,
    # experts priced by their compute alone, not by whether they are resident
    "moe-aware-noexperts": Policy(True, moe_aware_builder(price_experts=False)),
    "moe-aware-noresidency": Policy(True, moe_aware_builder(price_residency=False)),
    # offloaded: the experts a pass needs beyond the resident slots priced as plain misses
    "moe-aware-nooverflow": Policy(True, moe_aware_builder(price_overflow=False)),
    # offloaded: reads priced at the profile's fetch cost, not learnt from the run's passes
    "moe-aware-profilefetch": Policy(True, moe_aware_builder(learn_fetch=False)),
    # the sizing alone, with its own pause-and-probe gate: what the bound over fixed budgets adds
    "moe-aware-unbounded": Policy(True, moe_aware_builder(bounded=False)),
    # the bound without its difficulty adjustment (`BudgetBandit(adjust=False)`)
    "moe-aware-unadjusted": Policy(True, moe_aware_builder(adjust=False)),
    # the bound whose prior's scale tilts with the arms' tokens a step (`BudgetBandit.prior_tokens`)
    "moe-aware-tilted": Policy(True, moe_aware_builder(tilt=True)),
    # the bound judging its arms at the request's difficulty (`RequestDifficulty`), not the run's
    "moe-aware-request": Policy(True, moe_aware_builder(request_prior_steps=REQUEST_PRIOR_STEPS)),
}

AR = "ar"
# the best fixed tree measured on the embedded pair (static:3 and static:4 were best on the two prompt
# sets, greedy, one row; docs/measurements.md): the default where no profile prices the tree
FALLBACK_METHOD = "static:4"
# `static-best` is not run itself: it expands to this grid of fixed budgets, and the report names
# the budget with the best throughput in hindsight.
STATIC_BEST = "static-best"
STATIC_GRID = (1, 2, 3, 4, 6, 8, 16, 32, 60)  # PRODUCT.md's grid: small trees are where the best fixed budget sits


def static_grid_names() -> list[str]:
    return [f"static:{n}" for n in STATIC_GRID]


EXAMPLE_ARGUMENTS = {"static": "8", "chain": "3"}  # one runnable name of each method that takes a node count


def runnable_names() -> list[str]:
    """One runnable name per registered method (`static:8`, `chain:3`, the others as they are)."""
    return [f"{name}:{EXAMPLE_ARGUMENTS[name]}" if name in EXAMPLE_ARGUMENTS else name for name in METHODS]


def method_names() -> str:
    """Every accepted name, for help texts and messages: `ar, eagle2, static:N, static-best, ...`."""
    names = [name if policy.check_argument is _no_argument else f"{name}:N" for name, policy in METHODS.items()]
    return ", ".join(names[:3] + [STATIC_BEST] + names[3:])


def split_name(name: str) -> tuple[str, str | None]:
    """`"static:16"` -> `("static", "16")`; `"ar"` -> `("ar", None)` (a scheme suffix is dropped)."""
    base, _, arg = split_scheme(name)[0].partition(":")
    return base, (arg if arg else None)


def split_scheme(name: str) -> tuple[str, CandidateScheme]:
    """`"eagle2@sampled"` -> `("eagle2", SAMPLED)`; no suffix: `AUTO`."""
    plain, at, suffix = name.partition("@")
    if not at:
        return name, CandidateScheme.AUTO
    if suffix not in (CandidateScheme.TOP.value, CandidateScheme.SAMPLED.value):
        raise InputError(f"method {name!r}: the candidate scheme after '@' is 'top' or 'sampled', got {suffix!r}")
    return plain, CandidateScheme(suffix)


def check_name(name: str) -> None:
    """Raise `InputError` unless `name` is a registered method with a valid argument (and scheme), or
    `static-best` (with or without a scheme)."""
    plain, scheme = split_scheme(name)
    if plain == STATIC_BEST:
        return
    base, arg = split_name(name)
    policy = METHODS.get(base)
    if policy is None:
        raise InputError(f"unknown method {name!r}; known methods: {method_names()} (a drafting method takes "
                         f"@top or @sampled)")
    policy.check_argument(base, arg)
    if scheme is not CandidateScheme.AUTO and not policy.drafts:
        raise InputError(f"method {base!r} drafts nothing, so it takes no candidate scheme (got {name!r})")


def parse_methods(spec: str, option: str = "--methods", references: Collection[str] = ()) -> list[str]:
    """A comma-separated list of method names (`option` is the flag it came from, for messages),
    each checked against the registry; a name given twice is refused. `references` are names the
    caller runs itself, not built from the registry (bench's transformers loops, `hf-greedy`, ...)."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise InputError(f"no methods given; e.g. {option} ar,eagle2,static:16")
    for name in names:
        if name not in references:
            check_name(name)
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise InputError(f"{option}: methods given more than once: {duplicates}")
    return names


def expand_methods(names: list[str]) -> list[str]:
    """The methods to run: `static-best` (`static-best@sampled`) becomes the static grid (each with
    that suffix), without duplicates."""
    expanded: list[str] = []
    for name in names:
        plain, at, suffix = name.partition("@")
        grid = [f"{run}{at}{suffix}" for run in static_grid_names()]
        for run in (grid if plain == STATIC_BEST else [name]):
            if run not in expanded:
                expanded.append(run)
    return expanded


def check_runnable(name: str) -> None:
    """`check_name`, and `static-best` refused: one run decodes with one method."""
    check_name(name)
    if split_scheme(name)[0] == STATIC_BEST:
        raise InputError(f"{STATIC_BEST!r} is an aggregate over {', '.join(static_grid_names())} that bench and "
                         f"simulate report, not a method one run can use; pick one static:N")


def build_controller(name: str, profile: ProfileSource, adapt: bool = True, residency=None) -> Controller | None:
    """The controller of method `name`; `profile` is called only by methods that price nodes;
    `residency` (() -> [L, E] bool) reads an offloaded target's resident experts."""
    check_runnable(name)
    base, arg = split_name(name)
    try:
        return METHODS[base].build(arg, profile, adapt, split_scheme(name)[1], residency)
    except ValueError as error:  # a profile without what the controller reads (e.g. no calibration)
        raise InputError(f"method {name!r} cannot use this profile: {error}") from None


class MethodContext:
    """What methods are built from, shared by all methods of one run.

    The drafter is loaded on first use and then reused, so every drafting method runs the same
    head, and a run of `ar` alone never loads one; likewise the profile. `drafter_option` and
    `profile_option` name where a caller supplies them (`--drafter` on the command line,
    `drafter=` in Python), for the error raised when a method needs one that is missing.
    """

    def __init__(self, target: TargetModel, load_drafter: Callable[[], Drafter | None],
                 load_profile: ProfileSource | None = None, drafter_option: str = "--drafter",
                 profile_option: str = "--profile"):
        self.target = target
        self._load_drafter = load_drafter
        self._load_profile = load_profile
        self._drafter: Drafter | None = None
        self._profile = None
        self.drafter_option = drafter_option
        self.profile_option = profile_option
        self.profile_source: str | None = None  # where the profile came from, for the report

    def profile(self, method: str) -> "Profile":
        """The target's profile (calibration, cost model, expert predictor), loaded on first use."""
        if self._profile is None:
            if self._load_profile is None:
                raise InputError(f"method {method!r} needs a profile of the target; pass {self.profile_option}")
            profile = self._load_profile()
            offload = self.target.offload
            if offload is not None and profile.cost_model.num_layers and profile.cost_model.fetch is None:
                # offloaded experts priced by this machine's measured fetch cost (about a second to measure)
                profile = replace(profile, cost_model=replace(profile.cost_model, fetch=offload.measure_fetch_cost()))
                self.profile_source = (self.profile_source or "profile") + " + fetch cost measured now"
            if offload is not None and profile.cost_model.fetch is not None:
                # the overflow beyond the resident slots is priced at this run's cache size
                fetch = profile.cost_model.fetch.at_capacity(offload.capacity)
                profile = replace(profile, cost_model=replace(profile.cost_model, fetch=fetch))
                mismatch = reading_mismatch(profile, offload.config.layer_ahead)
                if mismatch:
                    warnings.warn(mismatch, stacklevel=2)
            self._profile = profile
        return self._profile

    def drafter(self, method: str) -> Drafter:
        if self._drafter is None:
            self._drafter = self._load_drafter()
        if self._drafter is None:
            raise InputError(f"method {method!r} needs a drafter; pass {self.drafter_option} "
                             f"(lookup, default or a head folder)")
        return self._drafter


@dataclass(frozen=True)
class Method:
    name: str  # as given, argument included: "static:16"
    drafter: Drafter | None
    controller: Controller | None


def build_method(name: str, context: MethodContext) -> Method:
    """Method `name` for a real run (online corrections on)."""
    check_runnable(name)
    drafter = context.drafter(name) if METHODS[split_name(name)[0]].drafts else None
    offload = context.target.offload
    return Method(name, drafter, build_controller(name, lambda: context.profile(name), adapt=True,
                                                  residency=offload.residency if offload is not None else None))


def reading_mismatch(profile, layer_ahead: bool) -> str | None:
    """Why `profile`'s fetch cost misprices a run that reads a layer ahead (`layer_ahead`) or on
    demand: its fetch scale was fitted on passes read the other way (`fetch_stage`'s report names
    how); None where they agree or the profile does not say."""
    report = profile.details.get("fetch_cost_report") or {}
    fitted = report.get("reading", reading_label(False) if report else None)  # reports before reading ahead: on demand
    running = reading_label(layer_ahead)
    if fitted is None or fitted == running:
        return None
    option = " --layer-ahead" if layer_ahead else ""
    return (f"the profile's fetch cost was fitted on passes that read their experts {fitted}, and this run reads "
            f"them {running}: misses are priced as they cost there (remake it with scripts/profile_fetch.py{option})")
