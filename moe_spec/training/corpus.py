"""The training corpus: the running Python's standard library sources.

Every machine has it, so the default target model can be rebuilt anywhere without a download.
Held-out text is split off by file (not by window), so held-out prompts come from modules the
model never saw.
"""

from __future__ import annotations

import hashlib
import platform
import random
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# A file is held out when sha1(relative path) mod HELDOUT_MODULUS == 0 (about 5%).
HELDOUT_MODULUS = 20
_EXCLUDED_DIRS = ("test/", "tests/", "idlelib/idle_test/", "lib2to3/tests/", "site-packages/", "dist-packages/")


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib root, "/"-separated
    text: str


@dataclass(frozen=True)
class Corpus:
    train_files: tuple[SourceFile, ...]
    heldout_files: tuple[SourceFile, ...]
    python_version: str
    sha256: str  # over every included file's relative path and raw bytes, in sorted order

    @property
    def n_chars(self) -> int:
        return sum(len(f.text) for f in self.train_files + self.heldout_files)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_excluded(rel_path: str) -> bool:
    """Tests and third-party packages are not part of the corpus."""
    wrapped = "/" + rel_path
    if any("/" + d in wrapped for d in _EXCLUDED_DIRS):
        return True
    return rel_path.rsplit("/", 1)[-1].startswith("test_")


def is_heldout(rel_path: str) -> bool:
    digest = hashlib.sha1(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_MODULUS == 0


@lru_cache(maxsize=4)
def load_corpus(root: str | None = None) -> Corpus:
    """Read the corpus from `root` (default: this interpreter's stdlib) in sorted path order."""
    base = Path(root) if root is not None else stdlib_root()
    rel_paths = sorted(
        p.relative_to(base).as_posix() for p in base.rglob("*.py") if p.is_file()
    )
    hasher = hashlib.sha256()
    train: list[SourceFile] = []
    heldout: list[SourceFile] = []
    for rel in rel_paths:
        if is_excluded(rel):
            continue
        raw = (base / rel).read_bytes()
        hasher.update(rel.encode("utf-8") + b"\0" + len(raw).to_bytes(8, "big") + raw)
        source = SourceFile(rel, raw.decode("utf-8", errors="replace"))
        (heldout if is_heldout(rel) else train).append(source)
    return Corpus(tuple(train), tuple(heldout), platform.python_version(), hasher.hexdigest())


def heldout_prompts(n: int, prompt_chars: int, seed: int, corpus: Corpus | None = None) -> list[str]:
    """`n` prompts of `prompt_chars` characters from held-out files, each starting at a line start.

    Deterministic for a given corpus and seed. Prompts whose text is mostly blank are skipped, and
    no two prompts share a starting line.
    """
    corpus = corpus if corpus is not None else load_corpus()
    candidates: list[tuple[int, int]] = []  # (file index, character offset of a line start)
    for i, source in enumerate(corpus.heldout_files):
        offset = 0
        for line in source.text.splitlines(keepends=True):
            if offset + prompt_chars <= len(source.text) and line.strip():
                candidates.append((i, offset))
            offset += len(line)
    rng = random.Random(seed)
    rng.shuffle(candidates)
    prompts: list[str] = []
    for i, offset in candidates:
        text = corpus.heldout_files[i].text[offset : offset + prompt_chars]
        if len(text.split()) >= prompt_chars // 40:  # not mostly whitespace
            prompts.append(text)
        if len(prompts) == n:
            return prompts
    raise ValueError(f"held-out files hold only {len(prompts)} prompts of {prompt_chars} characters")
