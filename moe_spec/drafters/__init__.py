"""Drafters: objects that propose a draft tree for the target to verify."""

from moe_spec.core.drafting import Drafter, TreeBudget
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.drafters.eagle_config import EagleConfig
from moe_spec.drafters.eagle_head import EagleHead
from moe_spec.drafters.lookup import LookupDrafter

__all__ = ["Drafter", "EagleConfig", "EagleDrafter", "EagleHead", "LookupDrafter", "TreeBudget"]
