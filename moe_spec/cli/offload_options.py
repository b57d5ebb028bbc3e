"""`--offload` and its options, shared by `generate`, `bench`, `demo` and `soak`.

    moe-spec bench --prompts p.jsonl --methods ar,eagle2 --offload disk --resident-experts 8

serves the target's routed experts from a slow tier through a resident cache of C experts per MoE
layer (see `moe_spec.offload.offloaded_experts`). The expert store is written once into
`--offload-dir` (default `runs/expert_store/<model folder>-<dtype>`) and reused (checked against the
model) by every later run.

The offload options other than `--offload` default to None here, so that one given without
`--offload` (or one that a cache kind ignores) is refused by name rather than silently unused;
the values they stand for when absent are `OffloadConfig`'s own defaults.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_spec.cli.defaults import field_defaults
from moe_spec.cli.option_types import non_negative_int, positive_int
from moe_spec.errors import InputError
from moe_spec.loading import model_folder
from moe_spec.offload.offloaded_experts import CACHES, TIERS, ExpertOffload, OffloadConfig, offload_experts
from moe_spec.offload.resident_cache import Eviction

OFFLOAD_DEFAULTS = field_defaults(OffloadConfig)
STORE_ROOT = Path("runs") / "expert_store"
EVICTIONS = tuple(e.value for e in Eviction)
# dest -> option, for the options that only mean something with --offload
_DEPENDENT = {"resident_experts": "--resident-experts", "offload_dir": "--offload-dir",
              "offload_cache": "--offload-cache", "eviction": "--eviction", "offload_workers": "--offload-workers",
              "prefetch": "--prefetch", "layer_ahead": "--layer-ahead"}


def add_offload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("expert offloading")
    group.add_argument("--offload", choices=TIERS, default=None,
                       help="serve the routed experts from this tier through a resident cache "
                            "(disk: O_DIRECT reads of the store file; host: pinned host memory, CUDA models only)")
    group.add_argument("--resident-experts", type=non_negative_int, default=None, metavar="C",
                       help=f"experts per MoE layer kept in fast memory (default {OFFLOAD_DEFAULTS['resident']}; "
                            "0: no cache, every pass reads each expert it uses)")
    group.add_argument("--offload-dir", default=None, metavar="DIR",
                       help=f"where the expert store is written once and reused (default: "
                            f"{STORE_ROOT}/<model folder>-<dtype>)")
    group.add_argument("--offload-cache", choices=CACHES, default=None,
                       help=f"default {OFFLOAD_DEFAULTS['cache']}; whole-layer: every pass reads all experts of "
                            "each layer (module-granular offloading, the peer the cache is measured against)")
    group.add_argument("--eviction", choices=EVICTIONS, default=None,
                       help=f"which resident expert a miss replaces (default {Eviction(OFFLOAD_DEFAULTS['eviction']).value})")
    group.add_argument("--offload-workers", type=positive_int, default=None, metavar="N",
                       help=f"parallel reads (default {OFFLOAD_DEFAULTS['workers']})")
    group.add_argument("--prefetch", action="store_const", const=True, default=None,
                       help="read the experts a plan predicts (moe-aware) ahead of their layers, while earlier "
                            "layers compute (default: off; see docs/offload.md)")
    group.add_argument("--layer-ahead", action="store_const", const=True, default=None,
                       help="while each MoE layer computes, read the experts the next layer's router picks for its "
                            "hidden states (default: off; see docs/offload.md)")


def offload_config(args: argparse.Namespace) -> OffloadConfig | None:
    """The `OffloadConfig` the options ask for (None without `--offload`); needs no model, so a
    command calls it before loading one and a bad combination is named first."""
    tier = getattr(args, "offload", None)
    given = [option for dest, option in _DEPENDENT.items() if getattr(args, dest, None) is not None]
    if tier is None:
        if given:
            raise InputError(f"{given[0]} needs --offload (disk or host)")
        return None
    cache = args.offload_cache or OFFLOAD_DEFAULTS["cache"]
    resident = OFFLOAD_DEFAULTS["resident"] if args.resident_experts is None else args.resident_experts
    _check_meaningful(args, cache, resident)
    return OffloadConfig(
        folder=args.offload_dir if args.offload_dir is not None else default_store_dir(args),
        tier=tier,
        resident=resident,
        cache=cache,
        eviction=args.eviction or OFFLOAD_DEFAULTS["eviction"],
        workers=args.offload_workers or OFFLOAD_DEFAULTS["workers"],
        prefetch=bool(args.prefetch),
        layer_ahead=bool(args.layer_ahead),
    )


def offload_from_args(args: argparse.Namespace, model) -> ExpertOffload | None:
    """Install the offload the options ask for on `model` (in place) and return its `ExpertOffload`;
    None without `--offload`. The caller closes it."""
    config = offload_config(args)
    return offload_experts(model, config) if config is not None else None


def offload_summary(offload: ExpertOffload) -> dict:
    """What a command's JSON reports of the offload: `ExpertOffload.summary()` with the settings as fields."""
    config = offload.config
    return {**offload.summary(), "tier": config.tier, "resident_experts": config.resident, "cache": config.cache,
            "eviction": config.eviction.value, "workers": config.workers, "prefetch": config.prefetch,
            "layer_ahead": config.layer_ahead}


def default_store_dir(args: argparse.Namespace) -> Path:
    """runs/expert_store/<model folder>-<dtype>: one store per checkpoint and weight dtype (a store
    holds the weights as they are loaded, so another dtype needs another store)."""
    folder = model_folder(getattr(args, "model", None))
    name = folder.parent.name if folder.name == "model" else folder.name  # a training run's model/ by its run
    return STORE_ROOT / f"{name}-{getattr(args, 'dtype', None) or 'float32'}"


def _check_meaningful(args: argparse.Namespace, cache: str, resident: int) -> None:
    """Refuse options the chosen cache ignores: a whole-layer pass reads every expert, so it keeps
    none resident and reads nothing ahead; with C = 0 there is nothing to evict or read ahead into."""
    if cache == "whole-layer":
        for dest in ("resident_experts", "eviction", "prefetch", "layer_ahead"):
            if getattr(args, dest) is not None:
                raise InputError(f"{_DEPENDENT[dest]} has no effect with --offload-cache whole-layer "
                                 "(every pass reads all experts of each layer); drop it")
    elif resident == 0:
        for dest, why in (("eviction", "no cache to evict from"), ("prefetch", "no slot to read ahead into"),
                          ("layer_ahead", "no slot to read ahead into")):
            if getattr(args, dest) is not None:
                raise InputError(f"{_DEPENDENT[dest]} has no effect with --resident-experts 0 ({why}); drop it")
