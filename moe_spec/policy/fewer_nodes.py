"""What a greedy step would have made with fewer nodes: paired evidence for the smaller fixed budgets.

Budgets nest (`moe_spec.core.drafting.Drafter`): from the same state a budget of k nodes drafts the
k best-scored nodes of what a budget of N > k nodes drafts, and `static:k` verifies exactly those.
Under greedy verification a node's label (its token is the target's argmax at its parent) is
computed over the node's own root path, so it does not depend on what else the pass verifies, and
siblings carry distinct tokens: the smaller tree accepts the part of the larger tree's accepted path
that it holds. A step that verified N nodes thus tells, exactly, the tokens every `static:k` (k < N)
would have made at the same position, on the same prompt, at no cost: a comparison of budgets on
the same steps, where measuring each on its own steps compares different prompts and accepted
lengths that swing by +-45% a step.
"""

from __future__ import annotations

from moe_spec.core.step_record import StepRecord


def tokens_with_fewer_nodes(record: StepRecord, nodes: int) -> float | None:
    """The tokens the step would have made had every row verified only its `nodes` best-scored
    drafted nodes (ties: the lower index, as `StaticController` keeps them), or None under sampled
    verification (whether a node is accepted then depends on the draws and on its siblings). The
    step must have verified what a fixed budget of at least `nodes` nodes kept (the caller's to know)."""
    if not record.sampling.greedy:
        return None
    total = 0
    for tree, acceptance in zip(record.verified, record.acceptances):
        drafted = tree.num_drafted
        if acceptance.num_accepted == 0 or nodes >= drafted:
            total += acceptance.num_accepted + 1  # the smaller budget keeps every node of this row
            continue
        scores = tree.scores.tolist()
        kept = set(sorted(range(1, drafted + 1), key=lambda i: (-scores[i], i))[:nodes])
        reached = 1  # the root: the bonus token is made however small the tree
        for node in acceptance.path[1:]:
            if node not in kept:
                break
            reached += 1
        total += reached
    return float(total)
