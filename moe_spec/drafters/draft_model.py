"""`DraftModelDrafter`: EAGLE-2 dynamic draft trees (`TreeDrafter`) grown by a small causal LM that
shares the target's tokenizer (transformers' `assistant_model`, vLLM's `draft_model`: Qwen3-0.6B for
Qwen3-30B-A3B, ...), run by `DraftModelRunner` with its own key/value cache. With branching 1 a
proposal is the greedy chain transformers' `AssistedCandidateGenerator` drafts.

The draft model's token ids are the target's: its vocabulary must be the target's size (a draft
model of another vocabulary is refused, naming both sizes).
"""

from __future__ import annotations

from moe_spec.core.drafting import TreeBudget
from moe_spec.core.target import TargetModel
from moe_spec.drafters.draft_model_runner import DraftModelRunner
from moe_spec.drafters.tree_drafter import TreeDrafter
from moe_spec.errors import InputError


def check_vocabularies(draft_model, target: TargetModel) -> None:
    """An `InputError` naming both sizes unless the draft model's output vocabulary is the target's."""
    drafted = int(draft_model.get_output_embeddings().weight.shape[0])
    embedded = int(draft_model.get_input_embeddings().num_embeddings)
    if drafted != target.vocab_size or embedded != target.vocab_size:
        raise InputError(
            f"the draft model's vocabulary ({drafted} output / {embedded} input tokens) does not map onto the "
            f"target's ({target.vocab_size} tokens): a draft model must share the target's tokenizer")


class DraftModelDrafter(TreeDrafter):
    """A `moe_spec.core.drafting.BatchDrafter` for any number of rows, drafting with a small causal LM."""

    def __init__(self, draft_model, target: TargetModel, budget: TreeBudget | None = None):
        check_vocabularies(draft_model, target)
        if getattr(draft_model.get_decoder(), "layers", None) is None:
            raise InputError(f"{type(draft_model).__name__} has no decoder layers to draft with")
        self.draft_model = draft_model.eval()
        device = target.model.get_input_embeddings().weight.device
        self.draft_model.to(device)
        super().__init__(DraftModelRunner(self.draft_model), lambda features: features[:, 0],
                         target.feature_layers, target, budget)
