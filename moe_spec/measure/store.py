"""Where a target's profile comes from when a command needs one and none was given.

Order: the profile shipped with the embedded pair (when both the target and the drafter are the
embedded ones), then a cached profile for this target and drafter, else a fresh profile built
on the given prompts and cached for next time. Calibration depends on the drafter, so the cache
key holds both the target's weights hash and the drafter's name.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from moe_spec.loading import ASSETS
from moe_spec.profile.artifact import Profile, fingerprint
from moe_spec.measure.profiler import ProfileSettings, build_profile
from moe_spec.core.target import TargetModel

DEFAULT_PROFILE = ASSETS / "default_profile.json"


def cache_dir() -> Path:
    return Path(os.environ.get("MOE_SPEC_CACHE", Path.home() / ".cache" / "moe_spec")) / "profiles"


def cached_profile_path(target: TargetModel, drafter_name: str) -> Path:
    return _cache_path(fingerprint(target)["weights_sha256"], drafter_name)


def _cache_path(weights_sha256: str, drafter_name: str) -> Path:
    drafter = hashlib.sha256(drafter_name.encode()).hexdigest()[:8]
    return cache_dir() / f"{weights_sha256[:16]}-{drafter}.json"


def existing_profile_path(target: TargetModel, drafter_name: str) -> Path | None:
    """The shipped profile where the target is the embedded one (by weights hash) and the drafter its
    head ('default'); else the profile cached for this target and drafter; else None."""
    weights = fingerprint(target)["weights_sha256"]
    if drafter_name == "default" and DEFAULT_PROFILE.is_file():
        if json.loads(DEFAULT_PROFILE.read_text())["fingerprint"]["weights_sha256"] == weights:
            return DEFAULT_PROFILE
    cached = _cache_path(weights, drafter_name)
    return cached if cached.is_file() else None


def profile_for(
    target: TargetModel,
    drafter,
    drafter_name: str,
    prompts: list[torch.Tensor],
    embedded: bool = False,
    settings: ProfileSettings | None = None,
    progress=None,
) -> tuple[Profile, str]:
    """The profile to use and where it came from ('shipped', 'cached' or 'built')."""
    if embedded and DEFAULT_PROFILE.is_file():
        return Profile.load(DEFAULT_PROFILE, target), "shipped"
    path = cached_profile_path(target, drafter_name)
    if path.is_file():
        return Profile.load(path, target), "cached"
    kwargs = {"progress": progress} if progress is not None else {}
    profile = build_profile(target, drafter, prompts, settings or ProfileSettings(), drafter_description=drafter_name, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    return profile, "built"
