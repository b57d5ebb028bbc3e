"""Prompt files: one JSON object per line with `prompt` (text) or `prompt_ids` (token ids), and an
optional `class`; other keys are kept as metadata. Read by `bench`, `profile` and `demo`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path

import torch

from moe_spec.errors import InputError


@dataclass(frozen=True)
class Prompt:
    prompt_class: str
    text: str | None = None
    ids: tuple[int, ...] | None = None
    meta: dict = field(default_factory=dict, compare=False)

    def input_ids(self, tokenizer) -> torch.Tensor:
        """[1, T] long: the given ids, or the text encoded as `moe-spec generate` encodes it."""
        if self.ids is not None:
            return torch.tensor([self.ids], dtype=torch.long)
        if tokenizer is None:
            raise InputError("the prompt file has text prompts but the model folder has no tokenizer; "
                             "give `prompt_ids` instead")
        ids = tokenizer(self.text, return_tensors="pt").input_ids
        if ids.shape[1] == 0:
            raise InputError(f"the {self.prompt_class!r} prompt {self.text[:40]!r} tokenizes to nothing")
        return ids

    def to_json(self) -> dict:
        body = {"prompt": self.text} if self.text is not None else {"prompt_ids": list(self.ids)}
        return {"class": self.prompt_class, **body, **self.meta}


def load_prompts(path: str | Path, limit_per_class: int | None = None) -> list[Prompt]:
    """The prompts of a JSON-lines file, in file order (the first `limit_per_class` of each class)."""
    path = Path(path)
    if limit_per_class is not None and (isinstance(limit_per_class, bool) or not isinstance(limit_per_class, int)
                                        or limit_per_class < 1):
        raise InputError(f"limit_per_class must be an integer >= 1 or None, got {limit_per_class!r}")
    if not path.is_file():
        raise InputError(f"no prompt file at {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    prompts: list[Prompt] = []
    taken: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        prompt = _parse_line(line, f"{path}:{number}")
        if limit_per_class is not None and taken.get(prompt.prompt_class, 0) >= limit_per_class:
            continue
        taken[prompt.prompt_class] = taken.get(prompt.prompt_class, 0) + 1
        prompts.append(prompt)
    if not prompts:
        raise InputError(f"{path} holds no prompts")
    return prompts


def in_class_turns(prompts: Sequence[Prompt]) -> list[Prompt]:
    """`prompts` with their classes taking turns (each class's first, in the order the classes first
    appear, then each one's second, ...), so that the first N of them hold every class alike. A
    prompt file is usually written class by class: a stage that decodes only its first few prompts
    (the profile's arm and fetch stages) would otherwise see one or two classes of it."""
    by_class: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_class.setdefault(prompt.prompt_class, []).append(prompt)
    turns = zip_longest(*by_class.values())
    return [prompt for turn in turns for prompt in turn if prompt is not None]


def _parse_line(line: str, where: str) -> Prompt:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as error:
        raise InputError(f"{where}: not JSON ({error})") from None
    if not isinstance(raw, dict):
        raise InputError(f"{where}: expected a JSON object")
    text, ids = raw.pop("prompt", None), raw.pop("prompt_ids", None)
    prompt_class = raw.pop("class", "all")
    if not isinstance(prompt_class, str) or not prompt_class:
        raise InputError(f"{where}: `class` must be a non-empty string, got {prompt_class!r}")
    if (text is None) == (ids is None):
        raise InputError(f"{where}: give exactly one of `prompt` (text) and `prompt_ids`")
    if text is not None and (not isinstance(text, str) or not text):
        raise InputError(f"{where}: `prompt` must be a non-empty string")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InputError(f"{where}: `prompt_ids` must be a non-empty list of integers")
        if min(ids) < 0:
            raise InputError(f"{where}: `prompt_ids` must be token ids >= 0, got {min(ids)}")
        ids = tuple(ids)
    return Prompt(prompt_class, text, ids, raw)
