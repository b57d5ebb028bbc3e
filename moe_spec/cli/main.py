"""The `moe-spec` command line. Each subcommand lives in its own module of `moe_spec.cli` with
`add_arguments(parser)` and `run(args) -> dict`; a command whose output machines read ends it with
one JSON line. `python -m moe_spec.cli.main COMMAND ...` works as well (e.g. under `accelerate launch`)."""

from __future__ import annotations

import argparse
import importlib
import sys

from moe_spec.cli import config_file
from moe_spec.errors import MoeSpecError

# subcommand -> (module, one-line help)
COMMANDS = {
    "generate": ("moe_spec.cli.generate", "decode a prompt with speculative decoding"),
    "demo": ("moe_spec.cli.demo", "the embedded pair: autoregressive vs EAGLE tree, side by side"),
    "bench": ("moe_spec.cli.bench", "compare decoding methods side by side on a prompt set"),
    "profile": ("moe_spec.cli.profile", "profile a target's expert activation and verify cost"),
    "train-target": ("moe_spec.cli.train_target", "train the embedded default MoE target"),
    "train-draft": ("moe_spec.cli.train_draft", "train an EAGLE-style draft head for a target"),
    "make-tiny": ("moe_spec.cli.make_tiny", "save a tiny random model of a supported architecture"),
    "make-random": ("moe_spec.cli.make_random", "save a random MoE with a real model's shapes (e.g. OLMoE-1B-7B)"),
    "simulate": ("moe_spec.cli.simulate", "replay a bench trace under another cost model (a simulation)"),
    "soak": ("moe_spec.cli.soak", "many mixed generations in one process: memory, hooks and speed over a long run"),
}


def build_parser(selected: str | None) -> argparse.ArgumentParser:
    """All subcommands are listed; only the selected one's module is imported (heavy imports stay lazy)."""
    parser = argparse.ArgumentParser(prog="moe-spec", description="Expert-aware speculative decoding for MoE models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text)
        if name == selected:
            module = importlib.import_module(module_name)
            module.add_arguments(command)
            config_file.add_config_option(command)
            command.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    selected = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(selected)
    try:
        if selected in COMMANDS:
            args = config_file.parse_args(parser, _command_parser(parser, selected), argv)
        else:
            args = parser.parse_args(argv)  # argparse reports the unknown command
        args._module.run(args)
    except MoeSpecError as error:
        print(f"moe-spec {selected}: error: {error}", file=sys.stderr)
        return 2
    return 0


def _command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


if __name__ == "__main__":
    sys.exit(main())
