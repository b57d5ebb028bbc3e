"""moe_spec: expert-aware speculative decoding for Mixture-of-Experts language models."""

from moe_spec.core.architectures import SUPPORTED_ARCHITECTURES
from moe_spec.drafters import Drafter, EagleDrafter, LookupDrafter, TreeBudget
from moe_spec.core.engine import GenerationResult, SpecDecoder
from moe_spec.errors import DrafterError, InputError, MoeSpecError, UnsupportedArchitectureError
from moe_spec.core.routing import Routing, RoutingRecorder
from moe_spec.core.target import TargetModel
from moe_spec.integrations.decoder import decoder
from moe_spec.core.tree import DraftTree

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Drafter",
    "DraftTree",
    "DrafterError",
    "EagleDrafter",
    "GenerationResult",
    "InputError",
    "LookupDrafter",
    "MoeSpecError",
    "Routing",
    "RoutingRecorder",
    "SpecDecoder",
    "TargetModel",
    "TreeBudget",
    "UnsupportedArchitectureError",
    "decoder",
]
