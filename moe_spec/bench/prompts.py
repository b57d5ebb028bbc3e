"""Benchmark prompt sets: reading them, and building them from the held-out corpus.

A prompt file is JSON lines, one prompt per line: `prompt` (text, encoded with the target's
tokenizer) or `prompt_ids` (token ids, for tokenizer-less tiny models), an optional `class`
(default "all") and any other keys, which are kept as metadata.

The shipped sets are built from the held-out files of the corpus (modules the target never saw),
in four classes that stress a drafter differently:

- `code`:   cut at the start of a statement inside a function body;
- `prose`:  cut inside a docstring or a block of comments;
- `copy`:   a block of lines, then the start of that same block again (the rest is a copy);
- `random`: random target tokens decoded to text (nothing a drafter can predict).

Every cut ends at a token boundary the tokenizer itself makes in running text (after the token
holding the newline, which may carry the next line's indentation), so a prompt's last token is
one the target saw in training. Each class draws from its own seeded `random.Random`, so a set
built with fewer prompts per class is a prefix of one built with more.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_spec.errors import InputError
from moe_spec.training.corpus import Corpus, SourceFile, load_corpus

CLASSES = ("code", "prose", "copy", "random")
MIN_TOKENS, MAX_TOKENS = 150, 300
_TARGET_TOKENS = (170, 270)  # drawn per prompt; cuts land on line starts, so lengths stray a little


@dataclass(frozen=True)
class BenchPrompt:
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
        return tokenizer(self.text, return_tensors="pt").input_ids

    def to_json(self) -> dict:
        body = {"prompt": self.text} if self.text is not None else {"prompt_ids": list(self.ids)}
        return {"class": self.prompt_class, **body, **self.meta}


def load_prompts(path: str | Path, limit_per_class: int | None = None) -> list[BenchPrompt]:
    """The prompts of a JSON-lines file, in file order (the first `limit_per_class` of each class)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no prompt file at {path}")
    prompts: list[BenchPrompt] = []
    taken: dict[str, int] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
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


def _parse_line(line: str, where: str) -> BenchPrompt:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as error:
        raise InputError(f"{where}: not JSON ({error})") from None
    if not isinstance(raw, dict):
        raise InputError(f"{where}: expected a JSON object")
    text, ids = raw.pop("prompt", None), raw.pop("prompt_ids", None)
    prompt_class = str(raw.pop("class", "all"))
    if (text is None) == (ids is None):
        raise InputError(f"{where}: give exactly one of `prompt` (text) and `prompt_ids`")
    if text is not None and (not isinstance(text, str) or not text):
        raise InputError(f"{where}: `prompt` must be a non-empty string")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InputError(f"{where}: `prompt_ids` must be a non-empty list of integers")
        ids = tuple(ids)
    return BenchPrompt(prompt_class, text, ids, raw)


# -- building the shipped sets -----------------------------------------------------------------


@dataclass(frozen=True)
class _Tokenized:
    """A held-out file, its line starts and its tokens' character spans."""

    source: SourceFile
    lines: list[str]
    line_starts: list[int]  # character offset of every line, plus len(text)
    token_starts: list[int]
    token_ends: list[int]
    tree: ast.AST | None  # the parsed module (None: not parsed)

    @staticmethod
    def of(source: SourceFile, tokenizer, parse: bool = True) -> "_Tokenized":
        lines = source.text.splitlines(keepends=True)
        starts = [0]
        for line in lines:
            starts.append(starts[-1] + len(line))
        encoded = tokenizer(source.text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        spans = encoded["offset_mapping"]
        tree = ast.parse(source.text) if parse else None
        return _Tokenized(source, lines, starts, [s for s, _ in spans], [e for _, e in spans], tree)

    def cut_before_line(self, index: int) -> int:
        """Where a prompt ending before line `index` (0-based) ends: after the token holding the newline."""
        start = self.line_starts[index]
        token = bisect.bisect_right(self.token_starts, start - 1) - 1
        end = self.token_ends[token] if token >= 0 else start
        # the newline token may run into the line's indentation, never into its text
        return end if start <= end and self.source.text[start - 1 : end].isspace() else start

    def window(self, end_line: int, tokens: int, whole_lines: bool = False) -> str | None:
        """The text from a line start up to the cut before `end_line` (or up to its start, for
        `whole_lines`), holding about `tokens` tokens; None when the file is too short before it."""
        end = self.line_starts[end_line] if whole_lines else self.cut_before_line(end_line)
        first_token = bisect.bisect_left(self.token_starts, end)
        for line in range(end_line - 1, -1, -1):
            start = self.line_starts[line]
            if first_token - bisect.bisect_left(self.token_starts, start) >= tokens and self.lines[line].strip():
                return self.source.text[start:end]
        return None


def _statement_lines(tree: ast.AST) -> list[int]:
    """0-based lines starting a statement inside a function body, after its first statement."""
    lines = set()
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = function.body[0].lineno
        for node in ast.walk(function):
            if isinstance(node, ast.stmt) and node is not function and node.lineno > first:
                lines.add(node.lineno - 1)
    return sorted(lines)


def _prose_lines(tree: ast.AST, lines: list[str]) -> list[int]:
    """0-based lines inside a docstring or a comment block (not its first line) that hold text."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            doc = node.body[0]
            for line in range(doc.lineno, doc.end_lineno):  # 0-based lines after the opening one
                if lines[line].strip().strip("\"'"):
                    found.add(line)
    run = 0
    for i, line in enumerate(lines):
        run = run + 1 if line.lstrip().startswith("#") else 0
        if run >= 2 and line.strip("#\n\t "):
            found.add(i)
    return sorted(found)


def _cut_prompts(files: list[_Tokenized], lines_of, rng: random.Random, n: int, tokenizer, name: str) -> list[BenchPrompt]:
    candidates = [(i, line) for i, f in enumerate(files) for line in lines_of(f)]
    rng.shuffle(candidates)
    used_files: set[int] = set()
    prompts: list[BenchPrompt] = []
    for i, line in candidates:
        if i in used_files:
            continue
        text = files[i].window(line, rng.randint(*_TARGET_TOKENS))
        if text is None or not MIN_TOKENS <= _count(tokenizer, text) <= MAX_TOKENS:
            continue
        used_files.add(i)
        prompts.append(_prompt(name, text, tokenizer, f"{files[i].source.path}:{line + 1}"))
        if len(prompts) == n:
            return prompts
    raise ValueError(f"the held-out files yield only {len(prompts)} {name!r} prompts, {n} wanted")


def _copy_prompts(files: list[_Tokenized], rng: random.Random, n: int, tokenizer) -> list[BenchPrompt]:
    """A block of function-body lines, a blank line, then the block's first few lines again."""
    candidates = [(i, line) for i, f in enumerate(files) for line in _statement_lines(f.tree)]
    rng.shuffle(candidates)
    used_files: set[int] = set()
    prompts: list[BenchPrompt] = []
    for i, line in candidates:
        if i in used_files:
            continue
        block = files[i].window(line, rng.randint(120, 200), whole_lines=True)
        if block is None:
            continue
        block_lines = block.splitlines(keepends=True)
        repeat = rng.randint(2, 4)
        if len(block_lines) < repeat + 4:
            continue
        text = _end_at_line_start(block + "\n" + "".join(block_lines[: repeat + 1]), tokenizer)
        if not MIN_TOKENS <= _count(tokenizer, text) <= MAX_TOKENS:
            continue
        used_files.add(i)
        prompts.append(_prompt("copy", text, tokenizer, f"{files[i].source.path}:{line + 1}"))
        if len(prompts) == n:
            return prompts
    raise ValueError(f"the held-out files yield only {len(prompts)} 'copy' prompts, {n} wanted")


def _end_at_line_start(text: str, tokenizer) -> str:
    """`text` minus its last line, cut after the token holding the newline before it."""
    lines = text.splitlines(keepends=True)
    source = SourceFile("<copy>", text)
    tokenized = _Tokenized.of(source, tokenizer, parse=False)
    return text[: tokenized.cut_before_line(len(lines) - 1)]


def _random_prompts(rng: random.Random, n: int, tokenizer) -> list[BenchPrompt]:
    special = set(tokenizer.all_special_ids)
    vocabulary = [i for i in range(len(tokenizer)) if i not in special and "\ufffd" not in tokenizer.decode([i])]
    prompts = []
    for _ in range(100 * n):
        text = tokenizer.decode(rng.choices(vocabulary, k=rng.randint(*_TARGET_TOKENS)))
        if MIN_TOKENS <= _count(tokenizer, text) <= MAX_TOKENS:
            prompts.append(_prompt("random", text, tokenizer, "random"))
            if len(prompts) == n:
                return prompts
    raise ValueError(f"decoded random tokens re-encode outside {MIN_TOKENS}..{MAX_TOKENS} tokens too often")


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text).input_ids)


def _prompt(name: str, text: str, tokenizer, source: str) -> BenchPrompt:
    return BenchPrompt(name, text, meta={"source": source, "n_tokens": _count(tokenizer, text)})


def build_prompt_sets(
    tokenizer, per_class: int = 8, seed: int = 0, classes: tuple[str, ...] = CLASSES, corpus: Corpus | None = None
) -> list[BenchPrompt]:
    """`per_class` prompts of each class from the held-out corpus, class by class; deterministic.

    `tokenizer` is a fast (offset-reporting) tokenizer, the target's.
    """
    unknown = sorted(set(classes) - set(CLASSES))
    if unknown:
        raise ValueError(f"unknown prompt classes {unknown}; known: {list(CLASSES)}")
    corpus = corpus if corpus is not None else load_corpus()
    needs_files = bool(set(classes) - {"random"})
    files = [_Tokenized.of(source, tokenizer) for source in corpus.heldout_files] if needs_files else []
    builders = {
        "code": lambda rng: _cut_prompts(files, lambda f: _statement_lines(f.tree), rng, per_class, tokenizer, "code"),
        "prose": lambda rng: _cut_prompts(files, lambda f: _prose_lines(f.tree, f.lines), rng, per_class, tokenizer, "prose"),
        "copy": lambda rng: _copy_prompts(files, rng, per_class, tokenizer),
        "random": lambda rng: _random_prompts(rng, per_class, tokenizer),
    }
    prompts: list[BenchPrompt] = []
    for name in classes:
        prompts.extend(builders[name](random.Random(f"{seed}:{name}")))
    return prompts


def write_prompts(prompts: list[BenchPrompt], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(p.to_json(), ensure_ascii=False) + "\n" for p in prompts))


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description="Write a benchmark prompt set built from the held-out corpus.")
    parser.add_argument("--tokenizer", required=True, help="folder of the target's tokenizer (save_pretrained)")
    parser.add_argument("--out", required=True, help="the JSON-lines file to write")
    parser.add_argument("--per-class", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--classes", default=",".join(CLASSES))
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    prompts = build_prompt_sets(tokenizer, args.per_class, args.seed, tuple(args.classes.split(",")))
    write_prompts(prompts, args.out)
    lengths = [p.meta["n_tokens"] for p in prompts]
    print(json.dumps({"out": args.out, "prompts": len(prompts), "min_tokens": min(lengths), "max_tokens": max(lengths)}))


if __name__ == "__main__":
    main()
