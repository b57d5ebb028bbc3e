"""`--config FILE`: a YAML file of option values for any `moe-spec` command.

    # configs/bench_default.yaml
    prompts: configs/bench/heldout.jsonl
    methods: [ar, eagle2, static-best, truncate, moe-aware, moe-aware-noexperts]
    max-new-tokens: 48

    moe-spec bench --config configs/bench_default.yaml --limit 1   # flags override the file

Keys are the command's long option names, with dashes or underscores (`max-new-tokens`,
`max_new_tokens`; the option's `dest` works too). Values go through the same `type` and `choices`
as on the command line; a flag is `true` / `false`; a list is written as a YAML list, and for an
option that takes one comma-separated string (`methods`, `per-expert-scale`) it is joined with
commas; a mapping is written as one `key=value,key=value` token (`sampling: [{temperature: 0.7,
top_p: 0.9}]` for `--sampling temperature=0.7,top_p=0.9`); `null` keeps an option whose default is
None unset. Relative paths are taken from the working directory, as on the command line. Values
are checked by the option's own `type` (ranges included, see `option_types`).

Precedence: command-line flags, then the file, then the command's defaults. A flag given on the
command line also displaces the file's value for the other members of its mutually exclusive group
(`--prompt-ids` on the command line wins over `prompt:` in the file). An unknown key, a bad value or a
malformed file is a `ConfigError` naming the file and the key.

Implemented once for every command, from the command's own argparse actions; argparse has no
public introspection, so this reads `parser._actions` and `parser._mutually_exclusive_groups`.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
from pathlib import Path

import yaml

from moe_spec.errors import InputError

CONFIG_OPTION = "--config"


class ConfigError(InputError):
    """A config file that cannot be applied to the command: unreadable, malformed, unknown key or bad value."""


def add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(CONFIG_OPTION, metavar="FILE", default=None,
                        help="YAML file of option values (keys: this command's option names); flags override it")


def parse_args(parser: argparse.ArgumentParser, command: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse `argv` with `parser`, whose selected subcommand parser `command` has `--config`, applying
    the config file (if one is given) under the command-line flags.

    The file's values become `command`'s defaults (and options they set stop being required), so
    `command` is meant to be built for this one parse, as `moe_spec.cli.main` builds it.
    """
    with _only_given(command):
        given = vars(parser.parse_args(argv))
    path = given.get("config")
    if path is None:
        return parser.parse_args(argv)
    values = load_config(path, command)
    for group in command._mutually_exclusive_groups:
        members = {a.dest for a in group._group_actions}
        if members & given.keys():
            values = {k: v for k, v in values.items() if k not in members}
        elif len(members & values.keys()) > 1:
            names = sorted(_long_name(a) for a in group._group_actions if a.dest in values)
            raise ConfigError(f"{path}: {' and '.join(names)} exclude each other; set one")
    values = {dest: value for dest, value in values.items() if dest not in given}
    command.set_defaults(**values)
    for action in command._actions:
        if action.dest in values:
            action.required = False
    for group in command._mutually_exclusive_groups:
        if any(a.dest in values for a in group._group_actions):
            group.required = False
    return parser.parse_args(argv)


def load_config(path: str | Path, command: argparse.ArgumentParser) -> dict:
    """dest -> converted value for each key of the YAML file at `path`, checked against `command`'s options."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror or error}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(f"{path} must hold a mapping of option names to values, got {type(document).__name__}")
    actions = option_actions(command)
    values = {}
    for key, value in document.items():
        action = actions.get(_normalise(key)) if isinstance(key, str) else None
        if action is None:
            raise ConfigError(_unknown_key_message(path, key, command, actions))
        if action.dest in values:
            raise ConfigError(f"{path}: {key!r} sets {_long_name(action)} a second time")
        values[action.dest] = convert(action, value, f"{path}: {key}")
    return values


def option_actions(command: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each name a config key may use (long option without dashes, and dest; underscores) -> its action."""
    names: dict[str, argparse.Action] = {}
    for action in command._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)) or not action.option_strings:
            continue
        if CONFIG_OPTION in action.option_strings:
            continue  # a config file does not name another one
        for option in action.option_strings:
            if option.startswith("--"):
                names[_normalise(option)] = action
        names.setdefault(_normalise(action.dest), action)
    return names


def convert(action: argparse.Action, value, where: str):
    """A YAML value for `action`, converted and checked as argparse would a command-line string."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {_long_name(action)} is a flag; give true or false, got {value!r}")
        return action.const if value else action.default
    if isinstance(action, argparse._CountAction):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where}: {_long_name(action)} counts; give a non-negative integer, got {value!r}")
        return value
    if value is None:
        if action.default is not None:
            raise ConfigError(f"{where}: null is not a value of {_long_name(action)} (its default is {action.default!r})")
        return None
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        items = value if isinstance(value, list) else [value]
        if action.nargs == "+" and not items:
            raise ConfigError(f"{where}: {_long_name(action)} needs at least one value")
        return [_scalar(action, item, where) for item in items]
    if isinstance(value, list):
        value = ",".join(str(_plain(item, action, where)) for item in value)
    return _scalar(action, value, where)


def _scalar(action: argparse.Action, value, where: str):
    text = str(_plain(value, action, where))
    try:
        converted = action.type(text) if action.type is not None else text
    except argparse.ArgumentTypeError as error:  # the option's own type says what it expected
        raise ConfigError(f"{where}: {_long_name(action)}: {error}") from None
    except (TypeError, ValueError) as error:
        kind = getattr(action.type, "__name__", "value")
        raise ConfigError(f"{where}: invalid {kind} value {value!r} for {_long_name(action)}: {error}") from None
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{where}: {value!r} is not a choice of {_long_name(action)} ({choices})")
    return converted


def _plain(value, action: argparse.Action, where: str):
    """A string or number, as one command-line token would be (YAML booleans are not); a mapping of
    names to strings or numbers becomes one `key=value,key=value` token."""
    if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
        return ",".join(f"{key}={_plain(item, action, where)}" for key, item in value.items())
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{where}: {_long_name(action)} takes a string or number, got {value!r}")
    return value


def _normalise(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


def _long_name(action: argparse.Action) -> str:
    return next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])


def _unknown_key_message(path: Path, key, command: argparse.ArgumentParser, actions: dict) -> str:
    known = sorted({_long_name(a).lstrip("-") for a in actions.values()})
    close = difflib.get_close_matches(_normalise(str(key)), list(actions), n=1)
    hint = f" (did you mean {_long_name(actions[close[0]]).lstrip('-')!r}?)" if close else ""
    return f"{path}: unknown key {key!r} for `{command.prog}`{hint}; known keys: {', '.join(known)}"


@contextlib.contextmanager
def _only_given(command: argparse.ArgumentParser):
    """While inside, parsing yields only the options given on the command line (no defaults, nothing required)."""
    saved = [(a, a.default, a.required) for a in command._actions]
    saved_groups = [(g, g.required) for g in command._mutually_exclusive_groups]
    saved_defaults = dict(command._defaults)
    try:
        for action in command._actions:
            action.default, action.required = argparse.SUPPRESS, False
        for group in command._mutually_exclusive_groups:
            group.required = False
        command._defaults = {}
        yield
    finally:
        for action, default, required in saved:
            action.default, action.required = default, required
        for group, required in saved_groups:
            group.required = required
        command._defaults = saved_defaults
