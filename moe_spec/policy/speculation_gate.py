"""`SpeculationGate`: when the sizing alone (`moe-aware-unbounded`) pauses drafting.

Drafting pauses, probing every `probe_every` steps, while the *measured* throughput of speculative
steps (tokens per ms of draft + plan + verify + acceptance over the last steps, `ThroughputTracker`)
falls below that of plain steps by more than its standard error; without online measurements (a
replay) the caller's model verdict decides instead. Rates are measured per batch size: when rows
leave the batch, what was measured at the old size is dropped. `moe-aware` itself runs with no
gate: its bandit's plain arm decides plain steps (`BoundedController`).
"""

from __future__ import annotations

from collections.abc import Callable

from moe_spec.policy.online_correction import ThroughputTracker


class SpeculationGate:
    def __init__(self, probe_every: int = 4):
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.probe_every = probe_every
        self.forget()

    def forget(self) -> None:
        """Drop every measurement (a request that does not persist what earlier ones learnt)."""
        self.rates = ThroughputTracker()
        self.rows = 1  # the batch's rows when `rates` measured its steps
        self.paused_steps = 0  # steps paused since a step last chose to draft

    def observe(self, rows: int, speculated: bool, tokens: float, ms: float) -> None:
        """A step of `rows` rows, speculative or plain, that made `tokens` in `ms` (all of it)."""
        if rows != self.rows:
            # a pass of fewer rows makes fewer tokens a ms, speculative or plain, so a window of
            # 16-row steps says nothing of 3-row ones, nor a plain rate measured at 16 rows
            self.rates, self.rows = ThroughputTracker(), rows
        self.rates.update(speculated, tokens, ms)

    def drafted(self) -> None:
        """A step chose to verify drafted nodes: the pause, if any, is over."""
        self.paused_steps = 0

    def pauses(self, plain_rate: Callable[[], float] | None, modelled_plain: bool) -> bool:
        """Whether the next step skips drafting: speculation measured below plain decoding
        (`plain_rate`: () -> a plain step's tokens per ms now), or, in a replay (`plain_rate`
        None: nothing measured), the model chose plain steps lately (`modelled_plain`); every
        `probe_every`-th such step drafts anyway."""
        loses = modelled_plain if plain_rate is None else self.rates.speculation_loses(plain_rate=plain_rate())
        if not loses:
            return False
        self.paused_steps += 1
        return bool(self.paused_steps % self.probe_every)
