"""Traces: EAGLE-2's decoding steps during a benchmark, one JSON line each, for `replay`.

The first line is the header:

    {"kind": "header", "format": "moe_spec.trace", "version": 1, "method": "eagle2", "budget": {...},
     "temperature": 0.0, "target": {fingerprint}, "profile": "OUT.profile.json", "profile_origin": ...,
     "profile_sha256": ..., "bench_config": {...}, "reproduces_bench_run": true, "recorded": "..."}

then one line per step:

    {"kind": "step", "prompt": 0, "class": "code", "step": 3, "prefix_len": 57,
     "tokens": [N], "parents": [N], "scores": [N],      # the verified tree, root first
     "candidate_nodes": 61,                             # nodes the drafter proposed, root included
     "argmax": [N],                                     # the target's argmax at each node
     "experts": [[[K] * N] * L],                         # routing of each node, per MoE layer
     "accepted_path": [0, 4, 9], "bonus_token": 812, "verify_ms": 31.2, "draft_ms": 6.1, "plan_ms": 0.1,
     "candidates": {"tokens": ..., "parents": ..., "scores": ...}}  # only when they differ from the verified tree

Each line is one row of a `StepRecord` (`moe_spec.core.step_record`), the engine's own record of a
step, and reads back as one (`step_from_json`).

EAGLE-2 verifies its whole candidate tree (a static 60-node budget over a 60-node tree), so each
step holds what the target said about every node it could have verified: `replay` can choose any
subtree of it and score the choice exactly (greedy). The trace is written by a separate `eagle2`
pass over the same prompts right after the timed runs, with the same settings and per-prompt
generators, so it reproduces the benchmark's `eagle2` output (checked: `reproduces_bench_run`); its
times are that pass's. The profile the benchmark used is copied beside the trace, so the trace is
self-contained.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moe_spec.core.acceptance import Acceptance
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.forest import StepForest
from moe_spec.core.routing import Routing, empty_routing
from moe_spec.core.step_record import DecodeObserver, StepRecord
from moe_spec.core.tree import DraftTree
from moe_spec.errors import InputError
from moe_spec.profile.artifact import Profile, fingerprint

FORMAT = "moe_spec.trace"
VERSION = 1


class TraceError(InputError):
    """A trace file that cannot be replayed: missing, malformed, of another version or inconsistent."""


def step_to_json(record: StepRecord, prompt_class: str, step: int) -> dict:
    """One line of a trace: a one-row `StepRecord` (`StepRecord.row`) of prompt `record.rows[0]`."""
    tree, candidates = record.tree(0), record.candidates[0]
    line = {
        "kind": "step", "prompt": record.rows[0], "class": prompt_class, "step": step,
        "prefix_len": record.prefix_lens[0], "tokens": tree.tokens.tolist(), "parents": tree.parents.tolist(),
        "scores": [round(float(s), 6) for s in tree.scores], "candidate_nodes": len(candidates),
        "argmax": record.node_argmax(0).tolist(), "experts": record.experts(0).tolist(),
        "accepted_path": list(record.acceptances[0].path), "bonus_token": record.acceptances[0].bonus_token,
        "verify_ms": round(record.verify_ms, 4), "draft_ms": round(record.draft_ms, 4), "plan_ms": round(record.plan_ms, 4),
        "accept_ms": round(record.accept_ms, 4),
    }
    if len(candidates) != len(tree) or not torch.equal(candidates.tokens, tree.tokens):
        line["candidates"] = {"tokens": candidates.tokens.tolist(), "parents": candidates.parents.tolist(),
                              "scores": [round(float(s), 6) for s in candidates.scores]}
    return line


def _tree_from_json(data: dict) -> DraftTree:
    return DraftTree(torch.tensor(data["tokens"], dtype=torch.long), torch.tensor(data["parents"], dtype=torch.long),
                     torch.tensor(data["scores"], dtype=torch.float32))


def step_from_json(data: dict, layers: tuple[int, ...], num_experts: int, vocab_size: int | None = None) -> StepRecord:
    """The one-row `StepRecord` a trace line holds. Traces written before candidates were stored
    (only their count) read the verified tree as the candidates. Token ids are checked against
    `vocab_size` when given, expert ids against `num_experts`, the accepted path against the tree."""
    if not isinstance(data, dict):
        raise ValueError(f"a step is a JSON object, got {type(data).__name__}")
    tree = _tree_from_json(data)
    experts = torch.tensor(data["experts"], dtype=torch.long)
    if experts.numel() == 0:
        experts = experts.reshape(0, len(tree), 0)
    argmax = torch.tensor(data["argmax"], dtype=torch.long)
    if argmax.shape != (len(tree),) or experts.dim() != 3 or experts.shape[1] != len(tree):
        raise ValueError(f"argmax {tuple(argmax.shape)} / experts {tuple(experts.shape)} do not fit {len(tree)} nodes")
    if experts.shape[0] != len(layers):
        raise ValueError(f"experts cover {experts.shape[0]} MoE layers, the traced target has {len(layers)}")
    if experts.numel() and (int(experts.min()) < 0 or int(experts.max()) >= num_experts):
        raise ValueError(f"expert ids outside 0..{num_experts - 1}")
    candidates = _tree_from_json(data["candidates"]) if "candidates" in data else tree
    path = [int(i) for i in data["accepted_path"]]
    if not path or path[0] != 0 or any(not 0 < b < len(tree) or int(tree.parents[b]) != a for a, b in zip(path, path[1:])):
        raise ValueError(f"accepted_path {path} is not a path from the root of the {len(tree)}-node tree")
    bonus = int(data["bonus_token"])
    if int(data["prompt"]) < 0 or int(data["prefix_len"]) < 1:
        raise ValueError(f"prompt {data['prompt']} / prefix_len {data['prefix_len']} must be >= 0 / >= 1")
    if vocab_size is not None:
        for name, ids in (("tokens", tree.tokens), ("candidate tokens", candidates.tokens), ("argmax", argmax),
                          ("bonus_token", torch.tensor([bonus]))):
            if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
                raise ValueError(f"{name} hold ids outside the traced target's vocabulary 0..{vocab_size - 1}")
    routing = Routing(layers, num_experts, experts) if layers else empty_routing()
    acceptance = Acceptance(path, bonus)
    return StepRecord((int(data["prompt"]),), (int(data["prefix_len"]),), (candidates,), StepForest((tree,)), (acceptance,),
                      argmax[None], routing, float(data["verify_ms"]), float(data["draft_ms"]), float(data.get("plan_ms", 0.0)),
                      accept_ms=float(data.get("accept_ms", 0.0)))


@dataclass(frozen=True)
class Trace:
    header: dict
    steps: list[StepRecord]  # one-row records, in file order; `rows[0]` is the prompt index
    classes: dict[int, str]  # prompt index -> its class
    path: Path

    @property
    def greedy(self) -> bool:
        return float(self.header.get("temperature", 0.0)) == 0.0

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer of the traced target (0: dense)."""
        return self.steps[0].routing.num_experts if self.steps and self.steps[0].routing.layers else 0

    def prompt_steps(self) -> Iterator[tuple[StepRecord, bool]]:
        """(step, whether it is its prompt's first) for every step in order: a replay starts a new
        `generate` call (and, offloaded, a cold cache) at each first step."""
        prompt = None
        for step in self.steps:
            yield step, step.rows[0] != prompt
            prompt = step.rows[0]

    def profile(self, override: str | Path | None = None) -> Profile:
        """The profile the benchmark used (copied beside the trace), or `override`; checked against the traced target."""
        named = self.header.get("profile")
        if override is None and not named:
            raise TraceError(f"trace {self.path} names no profile; pass --profile")
        if override is None and (not isinstance(named, str) or Path(named).name != named):
            raise TraceError(f"trace {self.path} names its profile {named!r}, not a file beside it; pass --profile")
        path = Path(override) if override is not None else self.path.parent / named
        profile = Profile.load(path)
        traced = self.header.get("target", {}).get("weights_sha256")
        if traced is not None and profile.fingerprint.get("weights_sha256") != traced:
            raise TraceError(f"profile {path} was made for another target than the one traced in {self.path}")
        return profile


class TraceWriter:
    """Writes a trace: the header on entry, then one line per `StepRecord` given to `observer`."""

    def __init__(self, path: str | Path, header: dict):
        self.path = Path(path)
        self.header = {"kind": "header", "format": FORMAT, "version": VERSION, **header}
        self._file = None
        self.steps = 0

    def __enter__(self) -> "TraceWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w")
        self._file.write(json.dumps(self.header) + "\n")
        return self

    def __exit__(self, *exc_info) -> None:
        self._file.close()

    def observer(self, prompt_index: int, prompt_class: str) -> "_PromptObserver":
        """A `SpecDecoder` observer writing the steps of one prompt's generation."""
        return _PromptObserver(self, prompt_index, prompt_class)

    def write(self, line: dict) -> None:
        self._file.write(json.dumps(line) + "\n")
        self.steps += 1


class _PromptObserver(DecodeObserver):
    """Writes each step of one prompt's generation (decoded alone, so every record has one row,
    whose caller index 0 becomes the prompt's index in the file)."""

    def __init__(self, writer: TraceWriter, prompt_index: int, prompt_class: str):
        self.writer, self.prompt_index, self.prompt_class = writer, prompt_index, prompt_class
        self.counter = itertools.count()

    def on_step(self, record: StepRecord) -> None:
        for b in range(record.batch):
            line = step_to_json(record.row(b), self.prompt_class, next(self.counter))
            line["prompt"] = self.prompt_index
            self.writer.write(line)


def record_bench_trace(
    path: str | Path,
    target,
    method,  # moe_spec.policy.registry.Method: the eagle2 method of the benchmark
    prompts: Sequence[torch.Tensor],  # each [1, T] long
    classes: Sequence[str],
    settings,  # moe_spec.experiments.runner.RunSettings
    profile: Profile,
    profile_origin: str | None,
    bench_config: dict,
    bench_new_ids: dict[int, tuple[int, ...]] | None = None,  # prompt index -> eagle2's output in the timed run
) -> dict:
    """Run `method` once more over `prompts`, recording every step; returns what the bench report notes."""
    from moe_spec.experiments.runner import prompt_generator

    path = Path(path)
    profile_path = path.with_name(path.stem + ".profile.json")
    profile.save(profile_path)
    budget = getattr(method.controller, "budget", None)  # StaticController's fixed budget
    header = {
        "method": method.name,
        "budget": asdict(budget) if budget is not None else None,
        "temperature": settings.temperature,
        "max_new_tokens": settings.max_new_tokens,
        "seed": settings.seed,
        "target": fingerprint(target),
        "profile": profile_path.name,
        "profile_origin": profile_origin,
        "profile_sha256": hashlib.sha256(profile_path.read_bytes()).hexdigest(),
        "bench_config": bench_config,
        "recorded": "a separate pass of the method over the benchmark's prompts after its timed runs, "
                    "same settings and per-prompt generators",
    }
    outputs = {}
    with TraceWriter(path, header) as writer:
        for index, (ids, prompt_class) in enumerate(zip(prompts, classes)):
            decoder = SpecDecoder(target, drafter=method.drafter, controller=method.controller,
                                  observer=writer.observer(index, prompt_class))
            result = decoder.generate(ids, max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                      generator=prompt_generator(settings.seed, index))
            outputs[index] = tuple(result.sequences[0, ids.shape[1]:].tolist())
    reproduces = None if bench_new_ids is None else all(outputs[i] == bench_new_ids.get(i) for i in outputs)
    _rewrite_header(path, {**writer.header, "reproduces_bench_run": reproduces})
    return {"path": str(path), "steps": writer.steps, "profile": str(profile_path), "reproduces_bench_run": reproduces}


def _rewrite_header(path: Path, header: dict) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines[0] = json.dumps(header) + "\n"
    path.write_text("".join(lines))


def read_trace(path: str | Path) -> Trace:
    """The header and steps of a trace file; `TraceError` naming the line for anything malformed.
    Lines are read one at a time, so memory follows the steps kept, not the file held twice."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as file:
            return _read_lines(path, file)
    except OSError as error:
        raise TraceError(f"cannot read trace {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise TraceError(f"trace {path} is not UTF-8 text (corrupt, or not a trace)") from None


def _read_lines(path: Path, file) -> Trace:
    first = file.readline()
    if not first:
        raise TraceError(f"trace {path} is empty")
    try:
        header = json.loads(first)
    except json.JSONDecodeError as error:
        raise TraceError(f"{path}:1: the header is not JSON ({error})") from None
    if not isinstance(header, dict) or header.get("kind") != "header" or header.get("format") != FORMAT:
        raise TraceError(f"{path}:1: not a moe_spec trace header (written by `moe-spec bench --trace`)")
    if header.get("version") != VERSION:
        raise TraceError(f"{path}: trace version {header.get('version')!r}; this moe_spec reads version {VERSION}")
    layers, num_experts, vocab_size = _traced_shapes(path, header.get("target") or {})
    steps, classes = [], {}
    for number, line in enumerate(file, start=2):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            if not isinstance(data, dict) or data.get("kind") != "step":
                raise ValueError(f"kind {data.get('kind') if isinstance(data, dict) else data!r}, expected 'step'")
            steps.append(step_from_json(data, layers, num_experts, vocab_size))
            classes[int(data["prompt"])] = str(data["class"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError,
                RuntimeError) as error:
            raise TraceError(f"{path}:{number}: malformed step ({type(error).__name__}: {error})") from None
    if not steps:
        raise TraceError(f"trace {path} holds no steps")
    return Trace(header, steps, classes, path)


def _traced_shapes(path: Path, target) -> tuple[tuple[int, ...], int, int | None]:
    """(MoE layers, experts, vocabulary or None) of the header's target fingerprint."""
    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    layers, experts, vocab = (target.get(k) for k in ("moe_layers", "num_experts", "vocab_size")) \
        if isinstance(target, dict) else (None, None, None)
    if (not isinstance(target, dict) or not isinstance(layers or [], list) or not all(count(i) for i in layers or [])
            or not count(experts or 0) or not (vocab is None or count(vocab))):
        raise TraceError(f"{path}:1: the header's target fingerprint is malformed ({target!r:.200})")
    return tuple(layers or ()), int(experts or 0), vocab
