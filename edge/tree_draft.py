"""Draft trees from a `ModelDrafter`'s LM: EAGLE-2-style dynamic trees (Li et al., arXiv 2406.16858).

The tree grows a depth at a time from the root (the newest committed token). Each node has a score,
the product of q along its path: the drafter's confidence that the target takes that path. Before any
child is drawn, the node budget left is spread best-first over (frontier node, child rank r) slots,
each worth score × the r-th largest probability of the node's q, against the nodes projected below
them (so that budget is kept for deeper levels where they promise more than another sibling here).
That gives each node a count of children from its own and its ancestors' information only. Each
expanded node then draws that many children from its q — the most likely tokens when greedy; draws
without replacement, in draw order, when sampled; the coupled draw and then the next most likely
when coupled — and the children that will be expanded are scored by the LM in one `feed_tree` pass.

Exactness of sampled trees (common/maths/tree_verification.py): a node's siblings must be the
drafter's draws themselves, in order, and their number must not depend on their own values; so no
child is ever dropped or reordered after it was drawn (no EAGLE-2 final reranking), and a child's
dist is its parent's truncated q, the one it was drawn from. With top_k = 1 the tree is the chain
`ModelDrafter.propose` drafts: the same tokens, fallback and stop rules, and generator draws.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.maths.bild import should_fall_back
from ..common.maths.sampling import logits_to_probs, penalize
from ..common.maths.sparse import SparseDist, truncate
from ..common.protocol.tree import ROOT
from .drafter import ModelDrafter, ranked_choices
from .eagle import EagleDrafter
from .proposal import Interrupt, Proposal


@dataclass(frozen=True)
class TreeBudget:
    """How large a draft tree may grow."""

    nodes: int  # nodes in all
    depth: int  # the longest root path, in nodes
    top_k: int  # children of one node at most

    def __post_init__(self) -> None:
        if min(self.nodes, self.depth, self.top_k) < 1:
            raise ValueError(f"a tree budget needs nodes, depth and top_k >= 1, got {self}")


@dataclass
class _Node:
    """A node whose children may be drawn (ROOT or a node index), with what they need."""

    index: int
    path: list[int]  # the tokens from depth 1 down to the node
    score: float  # product of q along the path
    logits: torch.Tensor | None = None  # the LM's logits after the path, [V], once scored


@dataclass
class _Expansion:
    """A scored node's q, ready for the allocation and the draws."""

    node: _Node
    probs: torch.Tensor  # [V]: the transformed q (greedy: the softmax at temperature 1 BiLD reads)
    dist: SparseDist | None  # the truncated q children are drawn from and sent with; None when greedy
    top: torch.Tensor  # the q of the most likely children, decreasing, top_k at most
    ranked: tuple[int, ...]  # the drafter's choices here, in child order (drafter.ranked_choices)
    low: bool  # max q < α_FB
    coupled_first: int | None = None  # coupled mode: the coupled draw here, the first child


def draft_tree(drafter: ModelDrafter, context: list[int], budget: TreeBudget,
               interrupt: Interrupt | None = None) -> Proposal:
    """A draft tree after `context` within `budget`: nodes in creation order (parents first, siblings
    in draw order), each with its parent's truncated q as its dist (None when greedy). A node is not
    expanded when its q falls below α_FB (fell_back; its children are still drawn, but not expanded,
    with keep_low_confidence, as a chain keeps its low-confidence token), after a stop id, at the
    depth limit, or once `interrupt()` turned true. The LM is left holding the context and the tree's
    nodes; its next advance drops the nodes and reuses the context."""
    if isinstance(drafter, EagleDrafter):
        raise TypeError("draft_tree drafts with a ModelDrafter's own LM; an EAGLE head drafts through its own cache")
    s = drafter.settings
    # Where the prompt ends for the penalties: fixed by the first context drafted after, as propose does.
    drafter._prompt_len = drafter._prompt_len or len(context)
    ids: list[int] = []
    parents: list[int] = []
    dists: list[SparseDist] = []
    ranked: list[tuple[int, ...]] = []
    fell_back = False
    if interrupt is not None and interrupt():
        return Proposal(ids, None if drafter.sampling.greedy else dists, fell_back, parents=(), ranked=ranked)
    frontier = [_Node(ROOT, [], 1.0, drafter.lm.advance(context))]
    lm_index = {ROOT: ROOT}  # node index -> its index among the LM's tree nodes (only expandable ones are fed)
    while True:
        expansions = [_expansion(drafter, context, node, budget.top_k) for node in frontier]
        fell_back = fell_back or any(e.low for e in expansions)
        if not s.drafting.keep_low_confidence:
            expansions = [e for e in expansions if not e.low]
        # The children go one level below the frontier; the depth limit leaves this many levels under them.
        counts = _allocate(expansions, budget.nodes - len(ids), budget.depth - len(frontier[0].path) - 1)
        frontier = []
        for e, k in zip(expansions, counts):
            for token, q in _draw(drafter, e, k):
                ids.append(token)
                parents.append(e.node.index)
                ranked.append(e.ranked)
                if e.dist is not None:
                    dists.append(e.dist)
                child = _Node(len(ids) - 1, e.node.path + [token], e.node.score * q)
                if not e.low and token not in s.stop_ids and len(child.path) < budget.depth:
                    frontier.append(child)
        if not frontier or len(ids) >= budget.nodes or (interrupt is not None and interrupt()):
            break
        rows = drafter.lm.feed_tree([ids[n.index] for n in frontier],
                                    [lm_index[parents[n.index]] for n in frontier])
        for node, row in zip(frontier, rows):
            lm_index[node.index] = len(lm_index) - 1
            node.logits = row
    return Proposal(ids, None if drafter.sampling.greedy else dists, fell_back, parents=tuple(parents),
                    ranked=ranked)


def _expansion(drafter: ModelDrafter, context: list[int], node: _Node, top_k: int) -> _Expansion:
    """The node's q as the chain computes it at the same place: penalties over context + path, the
    sampling transform, the BiLD test, and (sampling) the truncation to wire_top_k."""
    s = drafter.settings
    penalized = penalize(node.logits[None], drafter.sampling, context + node.path, drafter._prompt_len)[0]
    probs = logits_to_probs(penalized, drafter.sampling)
    dist = None if drafter.sampling.greedy else truncate(probs, s.drafting.wire_top_k)
    support = probs if dist is None else dist.probs
    top = support.topk(min(top_k, int((support > 0).sum()))).values
    # The coupled draw at the children's position, as the chain's.
    first = dist.coupled(s.seed, len(context) + len(node.path)) if dist is not None and s.coupled else None
    falls = should_fall_back(probs, s.drafting.fallback_threshold)
    return _Expansion(node, probs, dist, top, ranked_choices(probs, first), falls, first)


def _allocate(expansions: list[_Expansion], nodes: int, levels_below: int) -> list[int]:
    """Children per expansion: of this depth's slots (expansion, rank r), each worth score × the r-th
    largest q, and of the nodes projected below each slot down to the depth limit (a spine whose q
    is the node's own top q at every level), the `nodes` most valuable, best-first; only the slots
    are drawn now. Spending the whole budget on this depth instead would grow wide, shallow trees (4
    nodes: the root's 4 children); the projections keep budget for deeper levels where they promise
    more, so the tree grows about as the best-first tree of edge/tree_policy.py. A node's slots
    decrease with r (ties go to the lower rank, and a slot precedes its projections), so they are
    taken as a prefix: its count of children, fixed before any is drawn, from parents' values only."""
    values = []
    for i, e in enumerate(expansions):
        top = e.top.tolist()
        for r, q in enumerate(top):
            value = e.node.score * q
            values.append((-value, 0, i, r))
            # Nothing grows below the children of a low-confidence node: no budget is kept for it.
            for level in range(1, (0 if e.low else levels_below) + 1):
                values.append((-value * top[0] ** level, level, i, r))
    counts = [0] * len(expansions)
    for _, level, i, _ in sorted(values)[:max(nodes, 0)]:
        if level == 0:
            counts[i] += 1
    return counts


def _draw(drafter: ModelDrafter, e: _Expansion, k: int) -> list[tuple[int, float]]:
    """k distinct children of the node and the q of each (for its score), in draw order."""
    if k == 0:
        return []
    if e.dist is None:  # greedy: the k most likely
        first = int(e.probs.argmax())  # the chain's token, also where topk would break an exact tie otherwise
        tokens = [first] + [t for t in e.probs.topk(k).indices.tolist() if t != first][:k - 1]
        return [(t, float(e.probs[t])) for t in tokens]
    ids, probs = e.dist.ids, e.dist.probs
    if e.coupled_first is not None:
        # The coupled draw, then the likeliest others.
        first = e.coupled_first
        ranked = ids[torch.argsort(probs, descending=True, stable=True)].tolist()
        tokens = [first] + [t for t in ranked if t != first][:k - 1]
        q = dict(zip(ids.tolist(), probs.tolist()))
        return [(t, q[t]) for t in tokens]
    # k draws without replacement in draw order: torch draws them as an exponential race (Gumbel-top-k),
    # whose order is that of sequential draws with removal; for k = 1 it is exactly dist.sample's draw.
    order = torch.multinomial(probs, k, replacement=False, generator=drafter.generator)
    return list(zip(ids[order].tolist(), probs[order].tolist()))
