"""How the llama.cpp engine lays a draft tree out in sequence ids (llama.cpp has no attention mask:
a token sees the cells that carry its first sequence id, at positions up to its own)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ...common.protocol.tree import feed_depths
from .base import Feed


@dataclass(frozen=True)
class PlantedTree:
    """A tree scored in the tree context and not yet kept or cut."""

    start: int  # the session's length before the pass
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    sequences: tuple[tuple[int, ...], ...]  # per fed token, the ids of the leaves below it (the first rules)


def is_tree(feed: Feed) -> bool:
    """True for a feed with parents that are not a chain (a chain-shaped tree is scored as a chain)."""
    return feed.parents is not None and any(p != j - 1 for j, p in enumerate(feed.parents))


def plant(feed: Feed, free: Iterator[int]) -> PlantedTree:
    """The tree of `feed`, a sequence id per leaf from `free`: each token carries the ids of the leaves
    below it, so under its own first id it sees the cached context (which carries them all), its
    ancestors and itself, and no other token of the tree."""
    parents = tuple(feed.parents)
    sequences: list[list[int]] = [[] for _ in parents]
    for leaf in sorted(set(range(len(parents))) - set(parents)):
        seq_id, node = next(free), leaf
        while node >= 0:
            sequences[node].append(seq_id)
            node = parents[node]
    return PlantedTree(feed.kv.length, parents, tuple(feed_depths(parents)), tuple(map(tuple, sequences)))
