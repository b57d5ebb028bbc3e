"""`--json PATH` on every command that reports: the full report as JSON in PATH, or on stdout
as one line where PATH is `-`. (Machine-readable commands end with one summary JSON line either way.)"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

STDOUT = "-"


def add_json_argument(parser: argparse.ArgumentParser, what: str = "the full report") -> None:
    parser.add_argument("--json", dest="json_out", default=None, metavar="PATH",
                        help=f"write {what} as JSON here ('-': one line on stdout)")


def write_json(path: str | None, document: dict) -> None:
    """`document` into `path` (its folder made), on stdout for `-`, nowhere for None."""
    if path is None:
        return
    if path == STDOUT:
        print(json.dumps(document))
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1) + "\n")
