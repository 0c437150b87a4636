"""What one forward pass may carry, within what its engine can do: pure decisions the verifier applies
(cloud/core/verifier.py `step`)."""
from __future__ import annotations

from collections.abc import Sequence

from ...common.protocol.tree import leaves
from ...common.protocol.wire import DraftBlock
from ..engine.base import Capabilities
from .session import Session


def split_rounds(items: list[tuple[int, DraftBlock]], caps: Capabilities,
                 sessions: int) -> tuple[list[tuple[int, DraftBlock]], list[tuple[int, DraftBlock]]]:
    """(rounds for this pass, rounds for the next): at most `sessions` rounds, and trees within the
    engine's limits on leaves and on trees (a tree can always run: max_tree_nodes is capped to the leaf
    limit). Order is kept."""
    leaf_limit, tree_limit = caps.max_tree_leaves or float("inf"), caps.max_trees or float("inf")
    now, later, used, trees = [], [], 0, 0
    for item in items:
        block = item[1]
        count = leaves(block.parents) if block.is_tree else 0
        if len(now) >= sessions or (block.is_tree and now and (used + count > leaf_limit or trees + 1 > tree_limit)):
            later.append(item)
        else:
            now.append(item)
            used, trees = used + count, trees + block.is_tree
    return now, later


def opening_sessions(openings: Sequence[Session], budget: int, rounds: int, limit: int) -> int:
    """How many openings a pass with `budget` prompt tokens feeds (oldest first), when it may carry
    `limit` sessions and `rounds` rounds want to be in it: rounds come first, but a prompt to feed keeps
    at least one of the pass's sessions (so it advances even while rounds fill every pass)."""
    fed = 0
    for session in openings:
        if budget <= 0:
            break
        if session.remaining:
            fed += 1
            budget -= session.remaining
    return min(fed, max(1, limit - rounds)) if fed else 0


def tree_nodes(limit: int, caps: Capabilities) -> int:
    """The tree size a replica offers: the configured limit, none without tree masks, and never more
    leaves than one pass may carry."""
    if not caps.tree_masks:
        return 0
    return min(limit, caps.max_tree_leaves) if caps.max_tree_leaves else limit
