"""A read that fails in the middle of a forward: the forward raises `StoreError`, no slot is left
claiming an expert whose weights it does not hold, and once the store is whole again the very same
offload (its caches as the failure left them) gives the reference's logits and tokens."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from moe_spec import LookupDrafter, SpecDecoder
from moe_spec.offload.expert_fetch import PendingReads
from moe_spec.offload.expert_store import StoreError
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT, hf_greedy

from offload_helpers import NUM_EXPERTS, TOP_K, assert_same_logits, assert_slots_hold_their_experts, model_of, routed_experts

IDS = torch.tensor([REPETITIVE_PROMPT + PLAIN_PROMPT])
OTHER = torch.tensor([PLAIN_PROMPT[:2]])  # warms a few experts per layer


class Truncated:
    """The offload's store file cut at `offset` (in place: the open descriptor sees it), and restored."""

    def __init__(self, offload, offset: int):
        self.path = offload.store.path
        self.saved = self.path.read_bytes()
        self.offset = offset

    def __enter__(self):
        os.truncate(self.path, self.offset)
        return self

    def __exit__(self, *exc):
        with self.path.open("r+b") as file:  # the same file (inode), whole again
            file.write(self.saved)
        return False


def readable(offload, position: int, offset: int) -> set[int]:
    """Experts of MoE layer `position` whose block lies wholly before `offset`."""
    layout = offload.store.layout
    return {e for e in range(NUM_EXPERTS) if layout.offset(position, e) + layout.block_bytes <= offset}


CASES = {
    # where the file is cut, as (MoE layer, expert) of the first block lost
    "inside layer 1": (1, 3),
    "at layer 1": (1, 0),
    "inside layer 0": (0, 5),
}


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("cache", ["C=top_k", "C=5", "C=E", "no-cache", "whole-layer", "C=5 one worker"])
@pytest.mark.parametrize("cut", list(CASES))
def test_a_failed_read_mid_forward_leaves_the_cache_consistent(make_offloaded, arch, cache, cut):
    config = {"C=top_k": dict(resident=TOP_K), "C=5": dict(resident=5), "C=E": dict(resident=NUM_EXPERTS),
              "no-cache": dict(resident=0), "whole-layer": dict(cache="whole-layer"),
              "C=5 one worker": dict(resident=5, workers=1)}[cache]
    reference = model_of(arch)
    with torch.no_grad():
        want, want_other = reference(IDS).logits, reference(OTHER).logits
    model, offload = make_offloaded(arch, **config)
    with torch.no_grad():  # a warm cache first: the failing pass has hits, victims and admissions
        assert_same_logits(model(OTHER).logits, want_other, arch)
    warm = offload.residency().clone()
    needed = [set(n) for n in routed_experts(reference, IDS)]
    position, first_lost = CASES[cut]
    offset = offload.store.layout.offset(position, first_lost)
    to_read = needed[position] - (set() if cache == "whole-layer" else set(warm[position].nonzero().flatten().tolist()))
    assert cache == "whole-layer" or max(to_read) >= first_lost, "the pass must read a lost block"
    with Truncated(offload, offset):
        with pytest.raises(StoreError, match="truncated"), torch.no_grad():
            model(IDS)
        assert_slots_hold_their_experts(offload, reference)
        after = offload.residency()
        for position in range(2):
            resident = set(after[position].nonzero().flatten().tolist())
            was = set(warm[position].nonzero().flatten().tolist())
            # whatever is resident was resident before or was read whole from the part of the file left
            assert resident <= was | (needed[position] & readable(offload, position, offset))
        if cache == "whole-layer" or cache == "no-cache":
            assert not after.any()
    with torch.no_grad():  # the store is whole again: the same offload, as the failure left it
        assert_same_logits(model(IDS).logits, want, arch)
        assert_same_logits(model(OTHER).logits, want_other, arch)
    assert_slots_hold_their_experts(offload, reference)


@pytest.mark.parametrize("arch", ["olmoe", "phimoe"])
def test_a_generation_that_fails_on_a_read_leaves_the_offload_usable(make_offloaded, arch):
    reference = model_of(arch)
    expected = hf_greedy(reference, REPETITIVE_PROMPT, 10)
    model, offload = make_offloaded(arch, resident=3)
    decoder = SpecDecoder(model, drafter=LookupDrafter(), offload=offload)
    decoder.generate(torch.tensor([PLAIN_PROMPT]), max_new_tokens=4)
    with Truncated(offload, offload.store.layout.offset(1, 1)):
        with pytest.raises(StoreError):
            decoder.generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=10)
        assert_slots_hold_their_experts(offload, reference)
    result = decoder.generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=10)
    assert torch.equal(result.sequences, expected)


@pytest.mark.parametrize("scratch", [1, 2, None], ids=["one slot", "double-buffered 1+1", "double-buffered 2+2"])
def test_a_failed_overflow_read_keeps_the_admitted_experts_and_nothing_else(make_offloaded, monkeypatch, scratch):
    """C = top-k: a pass admits K experts (read and committed), then streams the rest through the
    scratch slots; the file is cut so that an overflow expert of layer 1 cannot be read."""
    from moe_spec.offload.resident_cache import LayerCache

    reference = model_of("qwen3_moe")
    plans = []
    plan = LayerCache.plan
    monkeypatch.setattr(LayerCache, "plan", lambda self, needed: plans.append(plan(self, needed)) or plans[-1])
    dry, dry_offload = make_offloaded("qwen3_moe", resident=TOP_K, scratch=scratch)
    with torch.no_grad():
        dry(IDS)
    admitted, overflow = {e for e, _ in plans[1].admitted}, plans[1].overflow  # layer 1's plan, cold
    assert len(admitted) == TOP_K and len(overflow) > 2 and max(overflow) > max(admitted)

    model, offload = make_offloaded("qwen3_moe", resident=TOP_K, scratch=scratch)
    with Truncated(offload, offload.store.layout.offset(1, max(overflow))):
        with pytest.raises(StoreError, match="truncated"), torch.no_grad():
            model(IDS)
        assert_slots_hold_their_experts(offload, reference)
        assert offload.residency().sum(1).tolist() == [TOP_K, TOP_K]
        assert set(offload.residency()[1].nonzero().flatten().tolist()) == admitted
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)


def test_pending_reads_raise_the_first_failure_after_every_read_finished():
    finished = []

    def read(delay: float, fail: bool):
        time.sleep(delay)
        finished.append(delay)
        if fail:
            raise StoreError(f"read failed after {delay}")

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(read, 0.0, True), pool.submit(read, 0.2, False), pool.submit(read, 0.1, True)]
        with pytest.raises(StoreError, match="after 0.0"):
            PendingReads(futures).wait()
        assert sorted(finished) == [0.0, 0.1, 0.2], "no read was still writing into a slot"


def test_an_interrupt_while_waiting_still_waits_for_every_read():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    read = Future()
    threading.Timer(0.3, lambda: read.set_result(None)).start()

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)  # Ctrl-C, while the read is in flight
        with pytest.raises(KeyboardInterrupt):
            PendingReads([read]).wait()
        assert read.done(), "wait() returned while a read was still in flight"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        read.result(timeout=5)  # the timer's read, finished before the next test
