"""`MtpDrafter`: EAGLE-2 dynamic draft trees (`TreeDrafter`) grown by the target's own
multi-token-prediction layers (transformers' `MtpModel`, run by `MtpRunner`), for B rows at once.

The MTP layers read the target's last hidden state after its final norm (feature id
`AFTER_FINAL_NORM`), as transformers' `MTPCandidateGenerator` feeds them; with branching 1 and a
depth of the layer count, a proposal is the chain transformers drafts. Their MoE block routes like
a target layer; the profile prices its cost as every drafter's, by measured draft time. Where the
target's experts are offloaded (`TargetModel.offload`), `from_target` offloads the MTP layers'
experts the same way (same tier, cache and resident count, their own store in a `mtp_layers`
folder beside the target's), so the MTP block pays for its cold experts as the target does.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from moe_spec.core.drafting import TreeBudget
from moe_spec.core.target import AFTER_FINAL_NORM, TargetModel
from moe_spec.drafters.mtp_layers import load_mtp_layers
from moe_spec.drafters.mtp_runner import MtpRunner
from moe_spec.drafters.tree_drafter import TreeDrafter


class MtpDrafter(TreeDrafter):
    """A `moe_spec.core.drafting.BatchDrafter` for any number of rows, drafting with the target's MTP layers."""

    def __init__(self, mtp, target: TargetModel, budget: TreeBudget | None = None):
        self.mtp = mtp.eval()
        self.offload = None  # the MTP layers' own `ExpertOffload`, where their experts are offloaded
        super().__init__(MtpRunner(self.mtp), lambda features: features[:, 0], (AFTER_FINAL_NORM,), target, budget)

    @staticmethod
    def from_target(target: TargetModel, budget: TreeBudget | None = None) -> "MtpDrafter":
        """The drafter of the MTP layers stored in `target`'s checkpoint (`load_mtp_layers`), their
        experts offloaded as the target's are."""
        drafter = MtpDrafter(load_mtp_layers(target.model), target, budget)
        if target.offload is not None:
            from moe_spec.offload.offloaded_experts import offload_experts

            config = target.offload.config
            drafter.offload = offload_experts(drafter.mtp, replace(config, folder=Path(config.folder) / "mtp_layers"))
        return drafter

    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp.layers)
