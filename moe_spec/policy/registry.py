"""The decoding methods a benchmark compares, by name.

Methods: `ar`, `eagle2` (60 nodes, depth 5, top-10), `static:N`, `static-best` (the grid 4, 8, 16,
32, 60; best budget in hindsight), `truncate` (EVICT-style cut under a token-count cost),
`moe-aware` (ours) and `moe-aware-noexperts` (ours without expert pricing, an ablation).

A method is what `SpecDecoder` needs besides the target: a drafter (None: plain autoregressive
decoding through the same cache machinery) and a controller (None: the drafter's own default
budget). A method is named `name` or `name:arg` (`static:16`). `METHODS` maps a name to a factory
`(arg, context) -> (drafter, controller)`; to add a method, write a factory and register it there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from moe_spec.core.control import Controller
from moe_spec.policy.static import StaticController
from moe_spec.policy.cost_aware import MoeAwareController, TruncateController, token_count_cost
from moe_spec.core.drafting import Drafter, TreeBudget
from moe_spec.errors import InputError
from moe_spec.core.target import TargetModel

if TYPE_CHECKING:
    from moe_spec.profile.artifact import Profile

EAGLE2_BUDGET = TreeBudget(max_nodes=60, max_depth=5, branching=10)  # EAGLE-2's published default


class MethodContext:
    """What factories build methods from, shared by all methods of one run.

    The drafter is loaded on first use and then reused, so every drafting method runs the same
    head, and a run of `ar` alone never loads one.
    """

    def __init__(self, target: TargetModel, load_drafter: Callable[[], Drafter | None],
                 load_profile: Callable[[], "Profile"] | None = None):
        self.target = target
        self._load_drafter = load_drafter
        self._load_profile = load_profile
        self._drafter: Drafter | None = None
        self._profile = None
        self.profile_source: str | None = None  # where the profile came from, for the report

    def profile(self, method: str):
        """The target's profile (calibration, cost model, expert predictor), loaded on first use."""
        if self._profile is None:
            if self._load_profile is None:
                raise InputError(f"method {method!r} needs a profile of the target; pass --profile")
            self._profile = self._load_profile()
        return self._profile

    def drafter(self, method: str) -> Drafter:
        if self._drafter is None:
            self._drafter = self._load_drafter()
        if self._drafter is None:
            raise InputError(f"method {method!r} needs a drafter; pass --drafter (lookup, default or a head folder)")
        return self._drafter


Factory = Callable[[str | None, MethodContext], tuple[Drafter | None, Controller | None]]


@dataclass(frozen=True)
class Method:
    name: str  # as given, argument included: "static:16"
    drafter: Drafter | None
    controller: Controller | None


def _no_argument(name: str, arg: str | None) -> None:
    if arg is not None:
        raise InputError(f"method {name!r} takes no argument, got {name}:{arg}")


def _ar(arg: str | None, context: MethodContext):
    _no_argument("ar", arg)
    return None, None


def _eagle2(arg: str | None, context: MethodContext):
    _no_argument("eagle2", arg)
    return context.drafter("eagle2"), StaticController(EAGLE2_BUDGET)


def _static(arg: str | None, context: MethodContext):
    """A fixed node budget with EAGLE-2's depth and branching: `static:N`."""
    if arg is None or not arg.isdigit() or int(arg) < 1:
        raise InputError(f"method 'static' needs a node budget >= 1, e.g. static:16 (got {arg!r})")
    budget = TreeBudget(int(arg), EAGLE2_BUDGET.max_depth, EAGLE2_BUDGET.branching)
    return context.drafter(f"static:{arg}"), StaticController(budget)


def _truncate(arg: str | None, context: MethodContext):
    _no_argument("truncate", arg)
    profile = context.profile("truncate")
    return context.drafter("truncate"), TruncateController(profile, token_count_cost(profile), budget=EAGLE2_BUDGET)


def _moe_aware(arg: str | None, context: MethodContext):
    _no_argument("moe-aware", arg)
    return context.drafter("moe-aware"), MoeAwareController(context.profile("moe-aware"))


def _moe_aware_without_experts(arg: str | None, context: MethodContext):
    """Ablation: calibrated values and token cost only, no expert pricing."""
    _no_argument("moe-aware-noexperts", arg)
    return context.drafter("moe-aware-noexperts"), MoeAwareController(context.profile("moe-aware-noexperts"), price_experts=False)


METHODS: dict[str, Factory] = {
    "ar": _ar,
    "eagle2": _eagle2,
    "static": _static,
    "truncate": _truncate,
    "moe-aware": _moe_aware,
    "moe-aware-noexperts": _moe_aware_without_experts,
}

# `static-best` is not run itself: it expands to this grid of fixed budgets, and the report names
# the budget with the best throughput in hindsight.
STATIC_BEST = "static-best"
STATIC_GRID = (4, 8, 16, 32, 60)


def expand_methods(names: list[str]) -> list[str]:
    """The methods to run: `static-best` becomes the static grid (without duplicates)."""
    expanded: list[str] = []
    for name in names:
        for run in ([f"static:{n}" for n in STATIC_GRID] if name == STATIC_BEST else [name]):
            if run not in expanded:
                expanded.append(run)
    return expanded


def split_name(name: str) -> tuple[str, str | None]:
    """`"static:16"` -> `("static", "16")`; `"ar"` -> `("ar", None)`."""
    base, _, arg = name.partition(":")
    return base, (arg if arg else None)


def parse_methods(spec: str) -> list[str]:
    """A comma-separated list of method names, checked against the registry (arguments are
    checked when the methods are built)."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise InputError("no methods given; e.g. --methods ar,eagle2,static:16")
    for name in names:
        if name != STATIC_BEST and split_name(name)[0] not in METHODS:
            raise InputError(f"unknown method {name!r}; known methods: {', '.join([*METHODS, STATIC_BEST])} (as name or name:arg)")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise InputError(f"methods given more than once: {duplicates}")
    return names


def build_method(name: str, context: MethodContext) -> Method:
    base, arg = split_name(name)
    factory = METHODS.get(base)
    if factory is None:
        raise InputError(f"unknown method {name!r}; known methods: {', '.join(METHODS)} (as name or name:arg)")
    drafter, controller = factory(arg, context)
    return Method(name, drafter, controller)
