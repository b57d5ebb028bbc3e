"""`EagleDrafter`: EAGLE-2 dynamic draft trees (`TreeDrafter`) grown by an EAGLE-3 head (`EagleHead`,
run by its `HeadRunner`), for B rows at once."""

from __future__ import annotations

from pathlib import Path

from moe_spec.core.drafting import TreeBudget
from moe_spec.core.target import TargetModel
from moe_spec.drafters.eagle_head import EagleHead
from moe_spec.drafters.head_runner import HeadRunner
from moe_spec.drafters.tree_drafter import TreeDrafter


class EagleDrafter(TreeDrafter):
    """A `moe_spec.core.drafting.BatchDrafter` for any number of rows, drafting with an `EagleHead`."""

    def __init__(self, head: EagleHead, target: TargetModel, budget: TreeBudget | None = None):
        head.check_fits(target)
        self.head = head.eval()
        self.embed = target.model.get_input_embeddings()  # the target's, frozen, used as is where the head has none
        self.head.to(self.embed.weight.device)
        super().__init__(HeadRunner(self.head, self.embed), self.head.fuse,
                         head.config.feature_layers_for(target.num_layers), target, budget)

    @staticmethod
    def from_pretrained(directory: str | Path, target: TargetModel, budget: TreeBudget | None = None) -> "EagleDrafter":
        return EagleDrafter(EagleHead.from_pretrained(directory), target, budget)

    def save_pretrained(self, directory: str | Path) -> None:
        self.head.save_pretrained(directory)
