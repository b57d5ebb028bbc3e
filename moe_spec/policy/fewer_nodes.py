"""What a step would have made with fewer nodes: paired evidence for the smaller fixed budgets.

Budgets nest (`moe_spec.core.drafting.Drafter`): from the same state a budget of k nodes drafts the
k best-scored nodes of what a budget of N > k nodes drafts, and `static:k` verifies exactly those;
a sampled chain of k nodes is the first k draws of a chain of N (each draw depends only on the
draws above it). A step that verified N nodes thus tells what every smaller budget would have made
at the same position, on the same prompt, at no cost: a comparison of budgets on the same steps,
where measuring each on its own steps compares different prompts and accepted lengths that swing
by +-45% a step.

What it tells is the *expected* tokens given the drafts: 1 + sum over the kept nodes n of
P(n on the accepted path), the product of P(a accepted | its parent reached) over n's root path
(`StepRecord.acceptance_probability`, exact, computed from the target's logits at every verified
node, reached or not: the tree mask computes each node's logits over its own root path). Under
greedy verification those are 0/1 and the sum is exactly the tokens the smaller tree makes. Under
sampling a node's chance depends on the siblings tried before it (recursive rejection), so it
holds for a subtree only where each node's kept children come first in the order verification
tries them: true of a sampled chain's prefix, checked for top candidates. The same expectation of
the whole tree is the step's own tokens without the luck of the acceptance draws.
"""

from __future__ import annotations

from moe_spec.core.step_record import StepRecord
from moe_spec.core.tree import DraftTree


def tokens_with_fewer_nodes(record: StepRecord, nodes: int | None = None) -> float | None:
    """The tokens the step makes on average given its drafts had every row verified only its
    `nodes` best-scored drafted nodes (ties: the lower index, as `StaticController` keeps them; a
    sampled chain: its first `nodes` draws); None: every node. None is returned where the record
    cannot tell it: a sampled tree with siblings, a sampled chain shorter than `nodes`, top
    candidates whose kept siblings are not the first tried. The step must have verified what a
    fixed budget of at least `nodes` nodes drafts (the caller's to know)."""
    return tokens_by_budget(record, (nodes,)).get(nodes)


def tokens_by_budget(record: StepRecord, budgets) -> dict[int | None, float]:
    """`tokens_with_fewer_nodes` for each of `budgets` (node counts, None: every node) that the
    record tells, computing each row's acceptance probabilities once."""
    told: dict[int | None, float] = {}
    rows: list[list[float]] = []  # per row: P(node on the accepted path), [N]
    for nodes in budgets:
        total = 0.0
        for row, tree in enumerate(record.verified):
            kept = _kept(tree, nodes, record.sampling.greedy)
            if kept is None:
                break
            if len(rows) <= row:
                rows.append(_reach(tree, record.acceptance_probability(row).tolist()))
            total += sum(r for r, keep in zip(rows[row], kept) if keep)  # the root's 1: the bonus token
        else:
            told[nodes] = total
    return told


def _reach(tree: DraftTree, probs: list[float]) -> list[float]:
    """[N] P(node on the accepted path) from P(node accepted | parent reached); root 1 (parents
    precede their children)."""
    parents = tree.parent_list
    reach = [1.0] * len(tree)
    for node in range(1, len(tree)):
        reach[node] = reach[parents[node]] * probs[node]
    return reach


def _kept(tree: DraftTree, nodes: int | None, greedy: bool) -> list[bool] | None:
    """[N] bool: the nodes a budget of `nodes` keeps of `tree` (root True), or None where that
    budget's tokens cannot be told from this tree."""
    drafted = tree.num_drafted
    if tree.sampled and drafted and drafted != tree.max_depth:
        return None  # sampled siblings: a smaller sampled tree is not a subtree of this one's draws
    if nodes is None or nodes >= drafted:
        if tree.sampled and nodes is not None and nodes > drafted:
            return None  # a longer chain would have drawn nodes this one did not
        return [True] * len(tree)
    if tree.sampled:
        return [depth <= nodes for depth in tree.depth_list]
    scores = tree.score_list
    order = sorted(range(1, drafted + 1), key=lambda i: (-scores[i], i))[:nodes]
    kept = [False] * len(tree)
    kept[0] = True
    for node in order:
        kept[node] = True
    if not greedy and not _first_tried(tree, kept):
        return None
    return kept


def _first_tried(tree: DraftTree, kept: list[bool]) -> bool:
    """Every kept node's earlier siblings (verification tries children in index order) are kept."""
    seen_dropped: set[int] = set()  # parents with a dropped child so far
    for node, parent in enumerate(tree.parent_list):
        if parent < 0:
            continue
        if not kept[node]:
            seen_dropped.add(parent)
        elif parent in seen_dropped:
            return False
    return True
