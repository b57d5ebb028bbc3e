"""Exceptions raised by moe_spec for bad input. Each names the problem it found."""


class MoeSpecError(ValueError):
    """Base class: the input cannot be decoded as given."""


class UnsupportedArchitectureError(MoeSpecError):
    """The target's architecture is not one moe_spec knows how to verify trees on."""


class DrafterError(MoeSpecError):
    """A drafter proposed something the target cannot verify (e.g. token ids outside its vocabulary)."""


class InputError(MoeSpecError):
    """The prompt, mask or generation settings are invalid for this target."""


class DraftHeadMismatchError(MoeSpecError):
    """A draft head was trained for a different target (vocabulary, width, depth or feature layers)."""
