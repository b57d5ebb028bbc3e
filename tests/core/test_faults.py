"""A fault at every place a step can fail, for every policy of the registry, on the embedded pair.

Each case arms one fault (an exception, or a KeyboardInterrupt as Ctrl-C would raise) to fire once,
at the N-th call of one site: the drafter (begin / propose / commit), the controller (begin / plan /
observe), the target's forward (a forward hook on a decoder layer: the prefill, a later step, the
first or the last layer), acceptance, the streamer, the observer. Then:
- the very exception reaches the caller;
- no hook is left on any module of the target or the draft head, grad mode is restored, and the
  decoder holds no new attribute (the cache lives and dies inside `generate`);
- the decoder's next call equals a fresh decoder's output (greedy for every policy; sampled with
  a seeded generator too for the policies whose trees do not depend on measured times).
The sites wrap the real parts (the real drafter, controller, model and acceptance run until the
fault fires and after it).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import moe_spec.core.engine as engine_module
from moe_spec.core.drafting import EAGLE2_BUDGET, TreeBudget, check_proposal
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.step_record import DecodeObserver
from moe_spec.core.target import TargetModel
from moe_spec.core.tree import DraftTree, chain_tree
from moe_spec.drafters.lookup import LookupDrafter
from moe_spec.errors import DrafterError
from moe_spec.experiments.soak import registered_hooks
from moe_spec.loading import load_drafter, load_target
from moe_spec.measure.store import DEFAULT_PROFILE
from moe_spec.policy.registry import MethodContext, build_method, runnable_names
from moe_spec.profile.artifact import Profile
from moe_spec.testing.helpers import REPETITIVE_PROMPT, hf_greedy
from moe_spec.testing.tiny_models import tiny_model

POLICIES = runnable_names()  # every registered policy
TIME_INDEPENDENT = {"ar", "eagle2", "static:8"}  # their trees do not depend on measured times
PROMPT = [[417, 1030, 95, 2211, 64, 1500, 33, 880]]
NEW_TOKENS = 10


class Fault(Exception):
    """The injected failure."""


@dataclass
class Trigger:
    """Fires `error` once, at the `at`-th call (1-based); every other call passes."""

    at: int
    error: type[BaseException] = Fault
    calls: int = 0
    fired: bool = False

    def tick(self, site: str) -> None:
        self.calls += 1
        if self.calls == self.at and not self.fired:
            self.fired = True
            raise self.error(f"injected at {site}, call {self.at}")


class _Faulty:
    """A real component, one of whose methods (`method`) fails once, at the trigger's call."""

    site = ""  # names the component in the injected error

    def __init__(self, inner, method: str, trigger: Trigger):
        self.inner, self.method, self.trigger = inner, method, trigger

    def _call(self, name, *args, **kwargs):
        if name == self.method:
            self.trigger.tick(f"{self.site}.{name}")
        return getattr(self.inner, name)(*args, **kwargs)


class FaultyDrafter(_Faulty):
    """The real batch drafter, one of whose methods fails once."""

    site = "drafter"

    def __init__(self, inner, method: str, trigger: Trigger):
        super().__init__(inner, method, trigger)
        self.default_budget = inner.default_budget

    def begin(self, *args, **kwargs):
        return self._call("begin", *args, **kwargs)

    def propose(self, *args, **kwargs):
        return self._call("propose", *args, **kwargs)

    def commit(self, *args, **kwargs):
        return self._call("commit", *args, **kwargs)

    def keep_rows(self, *args, **kwargs):
        return self._call("keep_rows", *args, **kwargs)


class FaultyController(_Faulty):
    """The real controller, one of whose calls fails once."""

    site = "controller"

    def begin(self, *args, **kwargs):
        return self._call("begin", *args, **kwargs)

    def plan(self, *args, **kwargs):
        return self._call("plan", *args, **kwargs)

    def observe(self, *args, **kwargs):
        return self._call("observe", *args, **kwargs)


class FaultyStreamer:
    def __init__(self, method: str, trigger: Trigger):
        self.method, self.trigger, self.tokens = method, trigger, []

    def put(self, value):
        if self.method == "put":
            self.trigger.tick("streamer.put")
        self.tokens += value.flatten().tolist()

    def end(self):
        if self.method == "end":
            self.trigger.tick("streamer.end")


class FaultyObserver(DecodeObserver):
    def __init__(self, method: str, trigger: Trigger):
        self.method, self.trigger = method, trigger

    def on_prefill(self, record):
        if self.method == "on_prefill":
            self.trigger.tick("observer.on_prefill")

    def on_step(self, record):
        if self.method == "on_step":
            self.trigger.tick("observer.on_step")


@pytest.fixture(scope="module")
def pair():
    target = TargetModel(load_target())
    drafter = load_drafter("default", target)
    # transformers installs its own hidden-state capturing hooks once, at the first forward that asks
    # for hidden states, and keeps them; warm up so that the counts below compare like with like
    SpecDecoder(target, drafter=drafter).generate(torch.tensor(PROMPT), max_new_tokens=2)
    return target, drafter


def method_of(target: TargetModel, name: str, drafter=None):
    """The registry's method `name` as a real run builds it; a fresh drafter unless one is given."""
    context = MethodContext(target, lambda: drafter if drafter is not None else load_drafter("default", target),
                            lambda: Profile.load(DEFAULT_PROFILE, target))
    return build_method(name, context)


def probes(name: str) -> list[dict]:
    """The requests whose outputs the next call must reproduce."""
    out = [dict(temperature=0.0)]
    if name in TIME_INDEPENDENT:
        out.append(dict(temperature=1.0, seed=7))
    return out


def run(decoder: SpecDecoder, probe: dict, **kwargs):
    generator = torch.Generator().manual_seed(probe["seed"]) if "seed" in probe else None
    return decoder.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, temperature=probe["temperature"],
                            generator=generator, **kwargs).sequences


_FRESH: dict[tuple, torch.Tensor] = {}


def fresh_output(target, name: str, probe: dict) -> torch.Tensor:
    key = (name, tuple(sorted(probe.items())))
    if key not in _FRESH:
        method = method_of(target, name)
        _FRESH[key] = run(SpecDecoder(target, drafter=method.drafter, controller=method.controller), probe)
    return _FRESH[key]


# (site, method, call number, error); the drafter and controller sites apply where the policy has one
SITES = [
    ("drafter", "begin", 1, Fault), ("drafter", "propose", 1, Fault), ("drafter", "propose", 2, KeyboardInterrupt),
    ("drafter", "commit", 2, Fault),
    ("controller", "begin", 1, Fault), ("controller", "plan", 2, Fault), ("controller", "observe", 1, Fault),
    ("controller", "observe", 2, KeyboardInterrupt),
    ("forward:last", "prefill", 1, Fault), ("forward:last", "step", 3, Fault), ("forward:first", "step", 2, Fault),
    ("forward:first", "step", 3, KeyboardInterrupt),
    ("acceptance", "accept", 2, Fault),
    ("streamer", "put", 1, Fault), ("streamer", "put", 3, KeyboardInterrupt), ("streamer", "end", 1, Fault),
    ("observer", "on_prefill", 1, Fault), ("observer", "on_step", 2, Fault),
]


def _case_id(case) -> str:
    site, method, at, error = case
    return f"{site}.{method}@{at}-{error.__name__}"


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("case", SITES, ids=_case_id)
def test_a_fault_reaches_the_caller_and_leaves_nothing_behind(pair, monkeypatch, name, case):
    target, shared_drafter = pair
    site, method_name, at, error = case
    method = method_of(target, name, shared_drafter)
    if site == "drafter" and method.drafter is None or site == "controller" and method.controller is None:
        pytest.skip(f"{name} has no {site}")
    trigger = Trigger(at, error)
    drafter = FaultyDrafter(method.drafter, method_name, trigger) if site == "drafter" else method.drafter
    controller = FaultyController(method.controller, method_name, trigger) if site == "controller" else method.controller
    observer = FaultyObserver(method_name, trigger) if site == "observer" else None
    streamer = FaultyStreamer(method_name, trigger) if site == "streamer" else None
    decoder = SpecDecoder(target, drafter=drafter, controller=controller, observer=observer)
    hooks = registered_hooks(target.model, shared_drafter.head)
    attributes = set(vars(decoder))
    handle = None
    if site.startswith("forward"):
        layers = target.model.model.layers
        layer = layers[-1] if site == "forward:last" else layers[0]
        handle = layer.register_forward_hook(lambda module, inputs, output: trigger.tick(f"{site}"))
    if site == "acceptance":
        real_accept = engine_module.accept

        def faulty_accept(*args, **kwargs):
            trigger.tick("acceptance")
            return real_accept(*args, **kwargs)

        monkeypatch.setattr(engine_module, "accept", faulty_accept)
    try:
        with pytest.raises(error, match=f"injected at {site}"):
            run(decoder, dict(temperature=0.0), streamer=streamer)
    finally:
        if handle is not None:
            handle.remove()
    assert trigger.fired
    assert registered_hooks(target.model, shared_drafter.head) == hooks, "a hook was left behind"
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    assert set(vars(decoder)) == attributes
    for probe in probes(name):
        assert torch.equal(run(decoder, probe), fresh_output(target, name, probe)), f"next call differs: {probe}"
    if streamer is not None:  # a streamer works again on the next call
        streamer.tokens.clear()
        out = run(decoder, dict(temperature=0.0), streamer=streamer)
        assert streamer.tokens == out[0].tolist()


# -- trees bounded: a drafter over its budget is refused before the target sees the tree -------------


class StarDrafter:
    """A per-sequence drafter that ignores its budget: the root and `size` children."""

    def __init__(self, size: int, budget: TreeBudget = TreeBudget(8, 3, 4)):
        self.size, self.default_budget = size, budget

    def begin(self, prompt, features):
        pass

    def commit(self, tokens, features):
        pass

    def propose(self, root_token, budget, sampling):
        return DraftTree.from_lists([root_token] + [3] * self.size, [-1] + [0] * self.size)


class ChainDrafter(StarDrafter):
    """A per-sequence drafter proposing a chain `size` deep whatever depth it is allowed."""

    def propose(self, root_token, budget, sampling):
        return chain_tree([root_token] + [3] * self.size)


class BatchOf:
    """A batch drafter returning `trees(roots)` instead of trees it built."""

    def __init__(self, trees, budget: TreeBudget = TreeBudget(8, 3, 4)):
        self.trees, self.default_budget = trees, budget

    def begin(self, prompts, features):
        pass

    def commit(self, tokens, features):
        pass

    def keep_rows(self, rows):
        pass

    def propose(self, roots, budget, max_depths, sampling, generator=None):
        return self.trees(roots)


@pytest.fixture(scope="module")
def tiny():
    target = TargetModel(tiny_model("qwen3_moe"))
    SpecDecoder(target, drafter=LookupDrafter()).generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=2)  # see `pair`
    return target


def _refused(target: TargetModel, drafter, match: str, max_new_tokens: int = 12):
    """The drafter's proposal is a DrafterError naming `match`; the target ran its prefill only, and the
    decoder decodes as plain greedy decoding with a well-behaved drafter afterwards."""
    forwards = []
    handle = target.model.lm_head.register_forward_hook(lambda module, inputs, output: forwards.append(1))
    hooks = registered_hooks(target.model)
    decoder = SpecDecoder(target, drafter=drafter)
    try:
        with pytest.raises(DrafterError, match=match):
            decoder.generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=max_new_tokens)
    finally:
        handle.remove()
    assert len(forwards) == 1, "the oversized tree never reached the target"
    assert registered_hooks(target.model) == hooks - 1
    decoder.drafter = LookupDrafter()
    assert torch.equal(decoder.generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=8).sequences,
                       hf_greedy(target.model, REPETITIVE_PROMPT, 8))


def test_a_ten_thousand_node_tree_is_refused_naming_the_drafter_and_sizes(tiny):
    _refused(tiny, StarDrafter(10_000), r"StarDrafter proposed 10000 drafted nodes for row 0, over its budget of 8")


def test_a_tree_deeper_than_the_budget_is_refused(tiny):
    _refused(tiny, ChainDrafter(5), r"ChainDrafter proposed a tree 5 deep for row 0, over the 3 it was allowed")


def test_a_tree_deeper_than_the_rows_remaining_tokens_is_refused(tiny):
    # 3 new tokens: the first root is one, so a step may draft at most 1 deep
    _refused(tiny, ChainDrafter(3), r"ChainDrafter proposed a tree 3 deep .* over the 1 it was allowed", max_new_tokens=3)


def test_a_batch_drafter_must_return_one_tree_per_row(tiny):
    _refused(tiny, BatchOf(lambda roots: [DraftTree.root_only(r) for r in roots] * 2), r"BatchOf returned 2 trees for a batch of 1")
    _refused(tiny, BatchOf(lambda roots: [list(roots)]), r"BatchOf returned a list for row 0, not a DraftTree")


def test_an_oversized_tree_is_refused_without_walking_it():
    huge = DraftTree.from_lists([0] * 10_001, [-1] + [0] * 10_000)
    with pytest.raises(DrafterError, match="10000 drafted nodes"):
        check_proposal("Huge", [huge], 1, EAGLE2_BUDGET, [5])
    assert not {"depths", "depth_list"} & set(huge.__dict__), "refused on its node count alone, before its depths"
    check_proposal("Huge", [huge.subtree(list(range(61)))], 1, EAGLE2_BUDGET, [5])  # within budget: accepted
