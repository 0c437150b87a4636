"""The shape of a draft tree: a parent index per node, in plain Python (no torch), shared by the wire's
validation, the engines' attention masks, the verification rules and the edge's tree builder.

A round's draft is a tree hanging off the *root*, the session's newest committed token. Node i has
token draft_ids[i] and parent parents[i]: ROOT (-1) for a child of the root, else the index of an
earlier node (parents precede children). Siblings are listed in the order the drafter drew them; a
sampled tree draws a node's children from the node's q without replacement, in that order
(docs/trees.md). A chain of n tokens is the tree (ROOT, 0, 1, ..., n-2), and an empty `parents` on
the wire means exactly that chain, so a chain request is a tree request with nothing to say.

Depth: a child of the root has depth 1; a node scores (and is scored at) the position of the
committed length plus its depth minus one, just as the chain token at that depth would be.
"""
from __future__ import annotations

from collections.abc import Sequence

from .errors import InvalidArgument

ROOT = -1


def chain_parents(n: int) -> tuple[int, ...]:
    """The parents of a chain of n nodes: each node's parent is the one before it."""
    return tuple(range(-1, n - 1))


def is_chain(parents: Sequence[int]) -> bool:
    """True when the tree is a chain (every node's parent is the node before it)."""
    return all(p == i - 1 for i, p in enumerate(parents))


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (1 for the root's children); assumes parents precede children."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p == ROOT else out[p] + 1)
    return out


def children(parents: Sequence[int]) -> list[list[int]]:
    """Children lists in draw order: entry 0 is the root's, entry i + 1 node i's."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[p + 1].append(i)
    return out


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from depth 1 down to `node` (ROOT: the empty path)."""
    path = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


def leaves(parents: Sequence[int]) -> int:
    """Nodes that are nobody's parent (any list of ints: counted before validation)."""
    return len(parents) - len({p for p in parents if p >= 0})


def feed_parents(parents: Sequence[int]) -> tuple[int, ...]:
    """The tree as an engine feeds it: the root first (index 0, its parent the cached context, -1),
    then node i at index i + 1 with its parent shifted by one as well."""
    return (-1, *(p + 1 for p in parents))


def feed_depths(parents: Sequence[int]) -> list[int]:
    """Each fed token's distance from the first (the root, which follows the cache: depth 0), for
    parents in the fed layout of `feed_parents`."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def check_tree(parents: Sequence[int], tokens: Sequence[int], max_nodes: int, max_depth: int) -> None:
    """InvalidArgument naming the first defect: a parent that does not precede its child, a tree
    deeper than `max_depth` or larger than `max_nodes`, or two siblings with the same token."""
    if len(parents) != len(tokens):
        raise InvalidArgument(f"draft_parents has {len(parents)} entries for {len(tokens)} draft_ids; they must match")
    if len(parents) > max_nodes:
        raise InvalidArgument(f"the draft tree has {len(parents)} nodes; this server allows at most {max_nodes}")
    seen: set[tuple[int, int]] = set()
    depth: list[int] = []
    for i, (p, token) in enumerate(zip(parents, tokens)):
        if not ROOT <= p < i:
            raise InvalidArgument(f"draft_parents[{i}] = {p}: a parent must be -1 (the newest committed token) "
                                  "or an earlier node")
        if (p, token) in seen:
            raise InvalidArgument(f"draft node {i} repeats the token of an earlier sibling")
        seen.add((p, token))
        depth.append(1 if p == ROOT else depth[p] + 1)
        if depth[-1] > max_depth:
            raise InvalidArgument(f"the draft tree is deeper than {max_depth} at node {i}")
