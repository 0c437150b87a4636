"""How large a draft tree to send: pure functions of the measured rank distribution, the drafter's,
the link's and the verifier's times (the chain's policy is edge/policy.py; the controller takes the
better of the two).

ρ_r is the probability that the target's next token is the drafter's r-th most likely one (r = 1 is
first-choice agreement α). If ranks at different depths are independent, the probability that a
node is on the accepted path is the product of ρ over the ranks along its path, and a round with a
tree T commits E(T) = 1 + Σ_{node ∈ T} P(node) tokens on average. The best tree of n nodes under
this model takes the n most probable nodes; since a child is never more probable than its parent,
growing the tree best-first finds it (Sequoia, arXiv 2402.12374, optimises the same objective by
dynamic programming; EAGLE-2, arXiv 2406.16858, grows its trees best-first by the drafter's own
confidence, which is what the edge's tree builder does once the size is chosen).

A round drafting a tree of n nodes costs its drafting, n times the measured time per tree node (a
level is one drafter pass, but each node still costs its own sampling transform and ranking: on the
llama.cpp drafter a node costs about what a chain token does), the round trip, and the verifier's pass
over n + 1 tokens: the cloud's measured t_v(n).
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from .policy import Rates

TREE_SIZES = (4, 8, 16, 32, 64)  # node budgets the policy compares (capped by the edge's and the server's)


@dataclass(frozen=True)
class Shape:
    """The size of one round's draft: at most `nodes` nodes, `depth` deep, `top_k` children per node.
    top_k = 1 is a chain of `nodes` tokens."""

    nodes: int
    depth: int
    top_k: int

    @property
    def is_chain(self) -> bool:
        """A chain: one child per node."""
        return self.top_k == 1


def best_tree(ranks: Sequence[float], nodes: int, max_depth: int) -> tuple[float, Shape]:
    """E(T) and the shape of the best tree of at most `nodes` nodes and `max_depth` levels whose
    children take the drafter's top len(ranks) choices, ranks[r] being ρ_{r+1}."""
    if nodes < 1 or not ranks or max_depth < 1:
        return 1.0, Shape(0, 0, 1)
    # Candidates (−P, depth, rank, P of the parent): popping the most probable grows the best tree.
    frontier = [(-ranks[0], 1, 0, 1.0)]
    expected, depth, top_k, taken = 1.0, 0, 1, 0
    while frontier and taken < nodes:
        neg_p, d, r, parent_p = heapq.heappop(frontier)
        p = -neg_p
        if p <= 0:
            break
        expected += p
        depth, top_k, taken = max(depth, d), max(top_k, r + 1), taken + 1
        if d < max_depth:
            heapq.heappush(frontier, (-p * ranks[0], d + 1, 0, p))  # its most likely child
        if r + 1 < len(ranks):
            heapq.heappush(frontier, (-parent_p * ranks[r + 1], d, r + 1, parent_p))  # its next sibling
    return expected, Shape(taken, depth, top_k)


def tree_rate(rates: Rates, ranks: Sequence[float], nodes: int, max_depth: int) -> tuple[float, Shape]:
    """Committed tokens per second of rounds with the best tree of at most `nodes` nodes, and its shape."""
    expected, shape = best_tree(ranks, nodes, max_depth)
    per_node = rates.tree_node_s or rates.draft_s
    seconds = shape.nodes * per_node + rates.rtt_s + rates.verify_s(shape.nodes)
    return expected / seconds, shape


def choose_tree(rates: Rates, ranks: Sequence[float], max_nodes: int, max_depth: int,
                max_top_k: int) -> tuple[float, Shape]:
    """The fastest tree size (rate, shape) among TREE_SIZES up to `max_nodes` (and `max_nodes` itself),
    children limited to the drafter's top `max_top_k`."""
    sizes = sorted({n for n in TREE_SIZES if n < max_nodes} | {max_nodes})
    return max((tree_rate(rates, ranks[:max_top_k], n, max_depth) for n in sizes), key=lambda rs: rs[0])
