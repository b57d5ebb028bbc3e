"""Seeded fuzzing of what callers hand `SpecDecoder.generate` and the drop-in `speculative_generate`.

Each case draws one value per parameter from a pool of valid and invalid values (tagged), calls the
entry point, and judges the outcome:
- every value valid: it must decode, and correctly: the input comes back as given, each row's new
  tokens are in the vocabulary, stop at the first EOS or at `max_new_tokens`, and under greedy (or
  top-k 1) equal a fresh decoder's greedy output on that row alone; a streamer got it all;
- some value invalid: it must raise `InputError` whose message names one of the invalid
  parameters. Nothing else passes: another exception type, a message naming a valid parameter, or a
  bad value decoded anyway. For the drop-in, transformers' `generate` checks some values itself
  before it calls `speculative_generate` (e.g. `temperature=nan` with `do_sample=True`); such an
  error passes only if it was raised before moe_spec was entered and a value really was invalid.

Used by tests/fuzz and scripts/fuzz_inputs.py (which prints the count and the distinct messages).
"""

from __future__ import annotations

import random
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from moe_spec.core.engine import GenerationResult, SpecDecoder
from moe_spec.core.stats import GenerationStats
from moe_spec.errors import InputError

PACKAGE = Path(__file__).resolve().parents[1]
MAX_NEW = 3  # the largest valid max_new_tokens drawn: decodes stay a few steps long


@dataclass(frozen=True)
class Choice:
    label: str
    make: Callable[[], object]  # a fresh value per case (generators and streamers hold state)
    bad: bool = False


@dataclass
class Outcome:
    cases: int = 0
    decoded: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # message (numbers masked) -> count
    failures: list[str] = field(default_factory=list)

    def add_refusal(self, message: str) -> None:
        key = re.sub(r"0x[0-9a-f]+", "0x…", message)
        self.refused[key] = self.refused.get(key, 0) + 1


class RecordingStreamer:
    def __init__(self):
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.flatten().tolist())

    def end(self) -> None:
        self.ended = True


class HalfStreamer:
    """Has `put` but no `end`: not a streamer."""

    def put(self, value) -> None:
        pass


# batch layouts: rows of token ids, left-padded with 0 to the widest
LAYOUTS = {
    "one row": [[11, 42, 7, 63, 20]],
    "repetitive row": [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5]],
    "one padded row": [[0, 0, 5, 6, 7]],  # padding given as tokens; the mask decides whether it is prompt
    "two rows": [[7, 7, 7], [11, 42, 7, 63, 20, 3]],
}


def _padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    if rows == LAYOUTS["one padded row"]:
        mask = torch.tensor([[0, 0, 1, 1, 1]])
    return ids, mask


def _with_last(ids: torch.Tensor, token: int) -> torch.Tensor:
    ids = ids.clone()
    ids[:, -1] = token  # the last column is a prompt token in every row (left padding)
    return ids


def input_id_choices(ids: torch.Tensor) -> list[Choice]:
    return [
        Choice("long", lambda: ids.clone()),
        Choice("int32", lambda: ids.int()),
        Choice("uint8", lambda: ids.to(torch.uint8)),
        Choice("float 5.7", lambda: ids.float() + 0.7, bad=True),
        Choice("float integral", lambda: ids.float(), bad=True),
        Choice("bool", lambda: ids.bool(), bad=True),
        Choice("list", lambda: ids.tolist(), bad=True),
        Choice("numpy", lambda: ids.numpy(), bad=True),
        Choice("1-D", lambda: ids[0].clone(), bad=True),
        Choice("3-D", lambda: ids[None].clone(), bad=True),
        Choice("no tokens", lambda: ids[:, :0].clone(), bad=True),
        Choice("no rows", lambda: ids[:0].clone(), bad=True),
        Choice("id 500", lambda: _with_last(ids, 500), bad=True),
        Choice("id -3", lambda: _with_last(ids, -3), bad=True),
        Choice("complex", lambda: ids.to(torch.complex64), bad=True),
    ]


def mask_choices(ids: torch.Tensor, mask: torch.Tensor) -> list[Choice]:
    right = mask.flip(1)  # zeros after the prompt: not left padding (where there is padding)
    zero_row = mask.clone()
    zero_row[0] = 0
    return [
        Choice("none", lambda: None),
        Choice("long", lambda: mask.clone()),
        Choice("bool", lambda: mask.bool()),
        Choice("int32", lambda: mask.int()),
        Choice("float", lambda: mask.float(), bad=True),
        Choice("value 2", lambda: mask * 2, bad=True),
        Choice("value -1", lambda: -mask, bad=True),
        Choice("right padding", lambda: right.clone(), bad=bool((mask == 0).any())),
        Choice("wrong shape", lambda: mask[:, 1:].clone(), bad=True),
        Choice("a row of zeros", lambda: zero_row, bad=True),
        Choice("list", lambda: mask.tolist(), bad=True),
    ]


def _choices(*good, bad=()) -> list[Choice]:
    return [Choice(repr(v), (lambda v=v: v)) for v in good] + [Choice(repr(v), (lambda v=v: v), bad=True) for v in bad]


MAX_NEW_TOKENS = _choices(1, 2, MAX_NEW, np.int64(2), bad=(0, -2, 2.5, True, "3", None, 300, float("nan")))
TEMPERATURE = _choices(0, 0.0, 1.0, 0.7, 2, np.float32(0.5), 1e-6,
                       bad=(-1.0, float("nan"), float("inf"), "1", None, True, 1e-10, torch.tensor(1.0), 1j))
TOP_K = _choices(0, 1, 5, 10**9, np.int64(3), bad=(-1, 2.5, "5", True, None, float("nan")))
TOP_P = _choices(1.0, 0.9, 1, 1e-9, bad=(0, 0.0, 1.5, -0.1, float("nan"), "0.9", None, True, float("inf")))
EOS = _choices(None, 2, [2, 7], [], (3,), {7}, np.int64(2), bad=(-1, 500, 2.5, "5", [5, "x"], True, [True], [2.0]))
EOS += [
    Choice("tensor([2])", lambda: torch.tensor([2])),
    Choice("tensor(5)", lambda: torch.tensor(5)),
    Choice("tensor([[5]])", lambda: torch.tensor([[5]]), bad=True),
    Choice("tensor(5.0)", lambda: torch.tensor(5.0), bad=True),
    Choice("object()", object, bad=True),
]
GENERATOR = [
    Choice("none", lambda: None),
    Choice("seeded", lambda: torch.Generator().manual_seed(3)),
    Choice("'seed'", lambda: "seed", bad=True),
    Choice("42", lambda: 42, bad=True),
    Choice("random.Random", lambda: random.Random(0), bad=True),
]
STREAMER = [
    Choice("none", lambda: None),
    Choice("recording", RecordingStreamer),
    Choice("object()", object, bad=True),
    Choice("'x'", lambda: "x", bad=True),
    Choice("put without end", HalfStreamer, bad=True),
]

# the words each parameter's messages use
NAMES = {
    "input_ids": ("input_ids",),
    "attention_mask": ("attention_mask",),
    "max_new_tokens": ("max_new_tokens",),
    "temperature": ("temperature",),
    "top_k": ("top_k",),
    "top_p": ("top_p",),
    "eos_token_id": ("eos_token_id",),
    "generator": ("generator",),
    "streamer": ("streamer",),
}


def _pick(rng: random.Random, pool: list[Choice], p_good: float) -> Choice:
    good = [c for c in pool if not c.bad]
    bad = [c for c in pool if c.bad]
    return rng.choice(good if rng.random() < p_good or not bad else bad)


class EngineFuzz:
    """Cases for `SpecDecoder.generate` on `decoders` (name -> decoder, all on one target model)."""

    def __init__(self, model, decoders: dict, seed: int = 0, p_good: float = 0.85):
        self.model = model
        self.decoders = decoders
        self.rng = random.Random(seed)
        self.p_good = p_good
        self.vocab = int(model.config.vocab_size)
        self.context = int(model.config.max_position_embeddings)
        self._reference_decoder = SpecDecoder(model)  # fresh, no drafter: greedy outputs are compared to it
        self._references: dict[tuple[int, ...], list[int]] = {}

    def reference(self, prompt: list[int]) -> list[int]:
        """A fresh decoder's greedy continuation of `prompt` alone, `MAX_NEW` tokens, no EOS."""
        key = tuple(prompt)
        if key not in self._references:
            out = self._reference_decoder.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, eos_token_id=[])
            self._references[key] = out.sequences[0, len(prompt):].tolist()
        return self._references[key]

    def run(self, cases: int, outcome: Outcome | None = None) -> Outcome:
        outcome = outcome or Outcome()
        for _ in range(cases):
            self.one(outcome)
        return outcome

    def one(self, outcome: Outcome) -> None:
        rng = self.rng
        layout = rng.choice(list(LAYOUTS))
        ids, mask = _padded(LAYOUTS[layout])
        picked = {
            "input_ids": _pick(rng, input_id_choices(ids), self.p_good),
            "attention_mask": _pick(rng, mask_choices(ids, mask), self.p_good),
            "max_new_tokens": _pick(rng, MAX_NEW_TOKENS, self.p_good),
            "temperature": _pick(rng, TEMPERATURE, self.p_good),
            "top_k": _pick(rng, TOP_K, self.p_good),
            "top_p": _pick(rng, TOP_P, self.p_good),
            "eos_token_id": _pick(rng, EOS, self.p_good),
            "generator": _pick(rng, GENERATOR, self.p_good),
            "streamer": _pick(rng, STREAMER, self.p_good),
        }
        decoder_name = rng.choice(list(self.decoders))
        values = {name: choice.make() for name, choice in picked.items()}
        bad = {name for name, choice in picked.items() if choice.bad}
        if values["streamer"] is not None and ids.shape[0] > 1:
            bad.add("streamer")  # a streamer needs one row
        if "input_ids" not in bad and "max_new_tokens" not in bad and ids.shape[1] + values["max_new_tokens"] > self.context:
            bad.add("max_new_tokens")
        described = f"{decoder_name}, {layout}, " + ", ".join(f"{n}={c.label}" for n, c in picked.items())
        outcome.cases += 1
        try:
            result = self.decoders[decoder_name].generate(**values)
        except InputError as error:
            message = str(error)
            named = [n for n in bad if any(word in message for word in NAMES[n])]
            if not bad:
                outcome.failures.append(f"refused a valid request ({described}): {message}")
            elif not named:
                outcome.failures.append(f"the message names none of {sorted(bad)} ({described}): {message}")
            else:
                outcome.add_refusal(message)
            return
        except Exception as error:  # the point of the fuzz: anything else is a failure, recorded with its case
            outcome.failures.append(f"{type(error).__name__} ({described}): {error}\n{traceback.format_exc(limit=-3)}")
            return
        if bad:
            outcome.failures.append(f"decoded despite bad {sorted(bad)} ({described})")
            return
        problem = self.check_result(result, ids, None if values["attention_mask"] is None else mask, values)
        if problem:
            outcome.failures.append(f"{problem} ({described})")
        else:
            outcome.decoded += 1

    def check_result(self, result, ids: torch.Tensor, mask: torch.Tensor | None, values: dict) -> str | None:
        """None when `result` is what the request asked for, else what is wrong."""
        max_new = int(values["max_new_tokens"])
        eos = _eos_set(values["eos_token_id"], self.model)
        sequences = result.sequences
        width = ids.shape[1]
        if sequences.shape[0] != ids.shape[0] or not torch.equal(sequences[:, :width], ids):
            return "the input does not come back as given"
        greedy = float(values["temperature"]) == 0 or int(values["top_k"]) == 1
        for b in range(ids.shape[0]):
            prompt = ids[b][mask[b].bool()].tolist() if mask is not None else ids[b].tolist()
            produced = result.stats.new_tokens_per_row[b]
            new = sequences[b, width: width + produced].tolist()
            if not 1 <= produced <= max_new or len(new) != produced:
                return f"row {b}: {produced} new tokens for max_new_tokens={max_new}"
            if any(not 0 <= t < self.vocab for t in new):
                return f"row {b}: new tokens outside the vocabulary: {new}"
            first_eos = next((i for i, t in enumerate(new) if t in eos), None)
            if first_eos is not None and first_eos != produced - 1:
                return f"row {b}: decoding went on past EOS: {new}"
            if first_eos is None and produced != max_new:
                return f"row {b}: stopped after {produced} of {max_new} tokens without EOS: {new}"
            if greedy:
                expected = self.reference(prompt)[:max_new]
                cut = next((i for i, t in enumerate(expected) if t in eos), None)
                expected = expected if cut is None else expected[: cut + 1]
                if new != expected:
                    return f"row {b}: greedy output {new} != a fresh decoder's {expected}"
        streamer = values["streamer"]
        if isinstance(streamer, RecordingStreamer):
            prompt = ids[0][mask[0].bool()].tolist() if mask is not None else ids[0].tolist()
            streamed = [t for put in streamer.puts[1:] for t in put]
            if not streamer.ended or streamer.puts[:1] != [prompt] or streamed != sequences[0, width:width + len(streamed)].tolist():
                return "the streamer did not get the prompt, every new token and end()"
        return None


def _eos_set(eos, model) -> set[int]:
    if eos is None:
        eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return {int(t) for t in torch.as_tensor(list(eos) if isinstance(eos, (set, tuple)) else eos).flatten().tolist()}


# the drop-in: what `model.generate(..., custom_generate=speculative_generate)` is handed
DROP_IN = {
    "max_new_tokens": _choices(1, 2, MAX_NEW, bad=(0, 2.5, True, "3", -1)),
    "do_sample": _choices(False, True, bad=("yes", 1)),
    "temperature": _choices(1.0, 0.7, bad=(float("nan"), -1.0, 0.0, 1e-10, "hot")),
    "top_k": _choices(0, 1, 5, bad=(-3, 2.5)),
    "top_p": _choices(1.0, 0.9, bad=(float("nan"), 1.5, 0.0)),
    "eos_token_id": _choices(2, [2, 7], bad=(500, -1, 2.5, "a")),
    "pad_token_id": _choices(0, 5, bad=(-5, 1.5)),
    "generator": [Choice("none", lambda: None), Choice("seeded", lambda: torch.Generator().manual_seed(1)),
                  Choice("'x'", lambda: "x", bad=True)],
    "drafter": [Choice("lookup", lambda: _lookup()), Choice("'lookup'", lambda: "lookup"), Choice("none", lambda: None),
                Choice("3", lambda: 3, bad=True)],
    "method": _choices(None, "ar", "eagle2@top", "static:4@sampled", bad=(3, "medusa")),
    "moe_streamer": [Choice("none", lambda: None), Choice("recording", RecordingStreamer),
                     Choice("3", lambda: 3, bad=True)],
    "attention_mask": None,  # from the layout, as for the engine
}
# sampling settings transformers ignores under greedy decoding (and so does the drop-in)
SAMPLING_ONLY = ("temperature", "top_k", "top_p", "generator")


def _lookup():
    from moe_spec.drafters.lookup import LookupDrafter

    return LookupDrafter()


class DropInFuzz:
    """Cases for `model.generate(..., custom_generate=speculative_generate)`."""

    def __init__(self, model, seed: int = 0, p_good: float = 0.93):
        self.model = model
        self.rng = random.Random(seed)
        self.p_good = p_good
        self.engine = EngineFuzz(model, {}, seed)  # its reference and result checks

    def run(self, cases: int, outcome: Outcome | None = None) -> Outcome:
        outcome = outcome or Outcome()
        for _ in range(cases):
            self.one(outcome)
        return outcome

    def one(self, outcome: Outcome) -> None:
        from moe_spec.integrations.hf_generate import speculative_generate

        rng = self.rng
        layout = rng.choice(list(LAYOUTS))
        ids, mask = _padded(LAYOUTS[layout])
        picked = {name: _pick(rng, pool, self.p_good) for name, pool in DROP_IN.items() if pool is not None}
        masks = mask_choices(ids, mask)
        if bool(mask.all()):  # `generate` drops an all-ones mask of any dtype before the drop-in sees it
            masks = [Choice(c.label, c.make, bad=False) if c.label == "float" else c for c in masks]
        picked["attention_mask"] = _pick(rng, [c for c in masks if c.label != "none"], self.p_good)
        values = {name: choice.make() for name, choice in picked.items()}
        bad = {name for name, choice in picked.items() if choice.bad}
        if values["method"] not in (None, "ar") and values["drafter"] is None:
            bad |= {"method", "drafter"}  # a drafting method needs a drafter
        ignored = set() if values["do_sample"] is True else set(SAMPLING_ONLY)
        if values["moe_streamer"] is not None and ids.shape[0] > 1:
            bad.add("moe_streamer")
        described = f"drop-in, {layout}, " + ", ".join(f"{n}={c.label}" for n, c in picked.items())
        outcome.cases += 1
        try:
            result = self.model.generate(ids, custom_generate=speculative_generate, **values)
        except InputError as error:
            message = str(error)
            if not bad:
                outcome.failures.append(f"refused a valid request ({described}): {message}")
            elif not [n for n in bad if _names(message, n)]:
                outcome.failures.append(f"the message names none of {sorted(bad)} ({described}): {message}")
            else:
                outcome.add_refusal(message)
            return
        except Exception as error:
            entered = any(Path(frame.filename).resolve().is_relative_to(PACKAGE)
                          for frame in traceback.extract_tb(error.__traceback__)[1:])
            if bad and not entered:  # transformers' own check, before it calls speculative_generate
                outcome.add_refusal(f"[transformers, before the drop-in] {type(error).__name__}: {error}")
                return
            outcome.failures.append(f"{type(error).__name__} ({described}): {error}\n{traceback.format_exc(limit=-3)}")
            return
        if bad - ignored:
            outcome.failures.append(f"decoded despite bad {sorted(bad - ignored)} ({described})")
            return
        sampled = values["do_sample"] is True
        engine_values = {
            "max_new_tokens": values["max_new_tokens"], "eos_token_id": values["eos_token_id"],
            "temperature": values["temperature"] if sampled else 0.0, "top_k": values["top_k"] if sampled else 0,
            "streamer": values["moe_streamer"],
        }
        eos = _eos_set(values["eos_token_id"], self.model)
        problem = self.engine.check_result(_as_result(result, ids.shape[1], eos), ids, mask, engine_values)
        if problem:
            outcome.failures.append(f"{problem} ({described})")
        else:
            outcome.decoded += 1


def _names(message: str, name: str) -> bool:
    words = {"moe_streamer": ("streamer",), "drafter": ("drafter",), "method": ("method",),
             "do_sample": ("do_sample",), "pad_token_id": ("pad_token_id",)}.get(name, NAMES.get(name, (name,)))
    return any(word in message for word in words)


def _as_result(sequences: torch.Tensor, width: int, eos: set[int]) -> GenerationResult:
    """The drop-in's [B, T + T_new] sequences as a `GenerationResult`: a row's new tokens run to its
    first EOS (the drop-in pads after it, as `generate` does), else to the end."""
    per_row = []
    for row in sequences[:, width:].tolist():
        first = next((i for i, t in enumerate(row) if t in eos), None)
        per_row.append(first + 1 if first is not None else len(row))
    return GenerationResult(sequences, GenerationStats(new_tokens_per_row=per_row))


def summary(outcome: Outcome) -> str:
    lines = [f"{outcome.cases} combinations: {outcome.decoded} decoded and checked, "
             f"{sum(outcome.refused.values())} refused, {len(outcome.failures)} failures",
             f"{len(outcome.refused)} distinct refusal messages:"]
    lines += [f"  {count:4d}  {message}" for message, count in sorted(outcome.refused.items(), key=lambda kv: -kv[1])]
    lines += [f"FAILURE: {failure}" for failure in outcome.failures[:20]]
    return "\n".join(lines)


def engine_decoders(model) -> dict:
    """The decoders the engine cases go through, reused from case to case (so a bad call that left
    state behind would show in a later greedy comparison): no drafter, prompt lookup, a random
    EAGLE head, and prompt lookup under a static controller."""
    from moe_spec.core.drafting import TreeBudget
    from moe_spec.core.target import TargetModel
    from moe_spec.drafters.eagle import EagleDrafter
    from moe_spec.drafters.lookup import LookupDrafter
    from moe_spec.policy.static import StaticController
    from moe_spec.testing.helpers import random_eagle_head

    target = TargetModel(model)
    return {
        "ar": SpecDecoder(target),
        "lookup": SpecDecoder(target, drafter=LookupDrafter()),
        "eagle": SpecDecoder(target, drafter=EagleDrafter(random_eagle_head(target), target)),
        "lookup+static": SpecDecoder(target, drafter=LookupDrafter(), controller=StaticController(TreeBudget(6, 3, 2))),
    }
