"""`moe_spec.decoder(model, drafter)`: a `SpecDecoder` with the best method for this target and machine.

`SpecDecoder(model, drafter, controller)` decodes with exactly what it is given (no controller: the
drafter's own tree). `decoder` picks, as `moe-spec generate` does:

- `method=` names any method of `moe_spec.policy.registry` (`moe-aware`, `static:4`, `eagle2`, ...);
- else `moe-aware` on a profile of this target: `profile=` (a `Profile` or a profile JSON); for a
  drafter named by string, the one `moe-spec profile` cached for the target and that drafter; for the
  embedded pair, the shipped one;
- else `FALLBACK_METHOD`, the best fixed tree measured so far, with a warning saying how to make a
  profile.

    import moe_spec
    decoder = moe_spec.decoder(model, drafter="lookup")        # or a head folder, or a Drafter
    result = decoder.generate(input_ids, max_new_tokens=64)
"""

from __future__ import annotations

import warnings
from pathlib import Path

from moe_spec.core.engine import SpecDecoder
from moe_spec.core.target import TargetModel
from moe_spec.errors import InputError
from moe_spec.loading import load_drafter
from moe_spec.measure.store import existing_profile_path
from moe_spec.policy.registry import FALLBACK_METHOD, MethodContext, build_method
from moe_spec.profile.artifact import Profile


def decoder(model, drafter="lookup", method: str | None = None, profile: Profile | str | Path | None = None,
            offload=None, observer=None) -> SpecDecoder:
    """A `SpecDecoder` for `model` (a transformers causal LM or a `TargetModel`) drafting with `drafter`
    (a `Drafter`, 'lookup', 'default' for the embedded head, a head folder, or None: plain decoding)."""
    target = model if isinstance(model, TargetModel) else TargetModel(model, offload=offload)
    drafter_name = drafter if isinstance(drafter, str) else None
    if isinstance(drafter, str):
        drafter = load_drafter(drafter, target)
    if profile is None and method is None and drafter_name is not None:
        profile = existing_profile_path(target, drafter_name)
    built_drafter, controller = method_for(target, drafter, method, profile, caller="moe_spec.decoder")
    return SpecDecoder(target, drafter=built_drafter, controller=controller, observer=observer)


def method_for(target: TargetModel, drafter, method: str | None, profile, caller: str, controller=None):
    """(drafter, controller) of `method` (None: `moe-aware` on `profile`, else `FALLBACK_METHOD` with a
    warning; with neither a drafter nor a method, plain decoding)."""
    if method is None:
        if controller is not None or drafter is None:
            if profile is not None:
                raise InputError("profile= is read by method= only; pass a method, or build the controller from it")
            return drafter, controller
        method = "moe-aware" if profile is not None else FALLBACK_METHOD
        if profile is None:
            warnings.warn(f"{caller}: no profile= of this target, so drafting {FALLBACK_METHOD} (the best fixed tree "
                          f"measured so far) rather than the cost-aware moe-aware; `moe-spec profile` makes one",
                          stacklevel=3)
    if controller is not None:
        raise InputError(f"give method= or controller=, not both (got method={method!r} and a {type(controller).__name__})")
    load_profile = None if profile is None else (
        lambda: profile if isinstance(profile, Profile) else Profile.load(profile, target))
    context = MethodContext(target, lambda: drafter, load_profile, drafter_option="drafter=", profile_option="profile=")
    built = build_method(method, context)
    return built.drafter, built.controller
