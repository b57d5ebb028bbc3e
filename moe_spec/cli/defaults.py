"""Option defaults read from the settings dataclasses, so each default is declared once (on the
dataclass) and a command's `--help` cannot drift from what the library does without the flag."""

from __future__ import annotations

import dataclasses


def field_defaults(settings_class) -> dict[str, object]:
    """Field name -> default for each field of the dataclass `settings_class` that has one."""
    defaults = {}
    for field in dataclasses.fields(settings_class):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = field.default_factory()
    return defaults
