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
    "train-draft": ("moe_spec.cli.train_draft", "train an EAGLE-3 draft head for a target (speculators layout)"),
    "convert-head": ("moe_spec.cli.convert_head", "rewrite an EAGLE-3 head folder in another published layout"),
    "export-vllm": ("moe_spec.cli.export_vllm", "a head and an MoE-aware speculation schedule, as a folder vLLM serves"),
    "make-tiny": ("moe_spec.cli.make_tiny", "save a tiny random model of a supported architecture"),
    "make-random": ("moe_spec.cli.make_random", "save a random MoE with a real model's shapes (e.g. OLMoE-1B-7B)"),
    "simulate": ("moe_spec.cli.simulate", "replay a bench trace under another cost model (a simulation)"),
    "soak": ("moe_spec.cli.soak", "many mixed generations in one process: memory, hooks and speed over a long run"),
}


class HelpWithDefaults(argparse.HelpFormatter):
    """Every option's help ends with its default (argparse's own formatter shows it only where a help
    text asks for it, and for options without one never)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or any(action.default is v for v in (None, False, argparse.SUPPRESS)) \
                or not action.option_strings or "(default" in text or "default:" in text:
            return text
        if isinstance(action.default, (list, tuple)):
            default = ",".join(str(v) for v in action.default)
        else:
            default = action.default
        return f"{text} (default: {default})".strip().replace("%", "%%")


def build_parser(selected: str | None) -> argparse.ArgumentParser:
    """All subcommands are listed; only the selected one's module is imported (heavy imports stay lazy)."""
    parser = argparse.ArgumentParser(prog="moe-spec", description="Expert-aware speculative decoding for MoE models.")
    parser.add_argument("--version", action="version", version=f"moe-spec {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpWithDefaults)
        if name == selected:
            module = importlib.import_module(module_name)
            module.add_arguments(command)
            config_file.add_config_option(command)
            for action in command._actions:  # argparse prints nothing for an option without help text
                if action.help is None and action.option_strings and action.default is not None:
                    action.help = "(default: %(default)s)"
            command.set_defaults(_module=module)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moe_spec")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "0.1.0 (not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    selected = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(selected)
    try:
        if selected in COMMANDS and not {"-h", "--help"} & set(argv):  # help: argparse's own, defaults shown
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
