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
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.step_record import DecodeObserver
from moe_spec.core.target import TargetModel
from moe_spec.experiments.soak import registered_hooks
from moe_spec.loading import load_drafter, load_target
from moe_spec.measure.store import DEFAULT_PROFILE
from moe_spec.policy.registry import METHODS, MethodContext, build_method
from moe_spec.profile.artifact import Profile

POLICIES = [name if name != "static" else "static:8" for name in METHODS]  # every registered policy
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


class FaultyDrafter:
    """The real batch drafter, one of whose methods fails once."""

    def __init__(self, inner, method: str, trigger: Trigger):
        self.inner, self.method, self.trigger = inner, method, trigger
        self.default_budget = inner.default_budget

    def _call(self, name, *args, **kwargs):
        if name == self.method:
            self.trigger.tick(f"drafter.{name}")
        return getattr(self.inner, name)(*args, **kwargs)

    def begin(self, *args, **kwargs):
        return self._call("begin", *args, **kwargs)

    def propose(self, *args, **kwargs):
        return self._call("propose", *args, **kwargs)

    def commit(self, *args, **kwargs):
        return self._call("commit", *args, **kwargs)

    def keep_rows(self, *args, **kwargs):
        return self._call("keep_rows", *args, **kwargs)


class FaultyController:
    """The real controller, one of whose calls fails once."""

    def __init__(self, inner, method: str, trigger: Trigger):
        self.inner, self.method, self.trigger = inner, method, trigger

    def _call(self, name, *args, **kwargs):
        if name == self.method:
            self.trigger.tick(f"controller.{name}")
        return getattr(self.inner, name)(*args, **kwargs)

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
