"""Benchmark prompt sets, built from the held-out corpus (the file format: `moe_spec.experiments.prompt_file`).

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
import hashlib
import json
import platform
import random
from dataclasses import dataclass
from pathlib import Path


from moe_spec.experiments.prompt_file import Prompt
from moe_spec.training.corpus import Corpus, SourceFile, is_excluded, load_corpus

CLASSES = ("code", "prose", "copy", "random")
MIN_TOKENS, MAX_TOKENS = 150, 300
_TARGET_TOKENS = (170, 270)  # drawn per prompt; cuts land on line starts, so lengths stray a little


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


def _cut_prompts(files: list[_Tokenized], lines_of, rng: random.Random, n: int, tokenizer, name: str) -> list[Prompt]:
    candidates = [(i, line) for i, f in enumerate(files) for line in lines_of(f)]
    rng.shuffle(candidates)
    used_files: set[int] = set()
    prompts: list[Prompt] = []
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


def _copy_prompts(files: list[_Tokenized], rng: random.Random, n: int, tokenizer) -> list[Prompt]:
    """A block of function-body lines, a blank line, then the block's first few lines again."""
    candidates = [(i, line) for i, f in enumerate(files) for line in _statement_lines(f.tree)]
    rng.shuffle(candidates)
    used_files: set[int] = set()
    prompts: list[Prompt] = []
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


def _random_prompts(rng: random.Random, n: int, tokenizer) -> list[Prompt]:
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


def _prompt(name: str, text: str, tokenizer, source: str) -> Prompt:
    return Prompt(name, text, meta={"source": source, "n_tokens": _count(tokenizer, text)})


def build_prompt_sets(
    tokenizer, per_class: int = 8, seed: int = 0, classes: tuple[str, ...] = CLASSES, corpus: Corpus | None = None
) -> list[Prompt]:
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
    prompts: list[Prompt] = []
    for name in classes:
        prompts.extend(builders[name](random.Random(f"{seed}:{name}")))
    return prompts


def foreign_corpus(folders: list[str | Path]) -> Corpus:
    """Every `.py` file (tests excluded) under `folders`, all of it held out: source the target never
    trained on, e.g. installed third-party packages, for a prompt set nothing was tuned on."""
    files = []
    for folder in folders:
        base = Path(folder)
        if not base.is_dir():
            raise ValueError(f"{base} is not a folder")
        for path in sorted(base.rglob("*.py")):
            rel = f"{base.name}/{path.relative_to(base).as_posix()}"
            if is_excluded(rel):
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            try:
                ast.parse(text)
            except SyntaxError:
                continue
            files.append(SourceFile(rel, text))
    digest = hashlib.sha256("".join(f.path + "\0" + f.text for f in files).encode()).hexdigest()
    return Corpus((), tuple(files), platform.python_version(), digest)


def write_prompts(prompts: list[Prompt], path: str | Path) -> None:
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
    parser.add_argument("--from", dest="folders", nargs="+", default=None, metavar="FOLDER",
                        help="cut prompts from these source folders (all held out) instead of the corpus's held-out files")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    corpus = foreign_corpus(args.folders) if args.folders else None
    prompts = build_prompt_sets(tokenizer, args.per_class, args.seed, tuple(args.classes.split(",")), corpus)
    write_prompts(prompts, args.out)
    lengths = [p.meta["n_tokens"] for p in prompts]
    print(json.dumps({"out": args.out, "prompts": len(prompts), "min_tokens": min(lengths), "max_tokens": max(lengths)}))


if __name__ == "__main__":
    main()
