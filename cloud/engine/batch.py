"""How a pass's feeds are laid out for the kernels: tokens packed one after another, and attention
*groups* — queries that read the same keys in the same order.

A chain feed (a round, a cloud-only decode step, a prompt chunk) is one group: its queries read the
session's keys at positions 0..their own, cached and fed alike. A draft tree is one group per node:
the node reads the cache and then its own root path, in position order, exactly the keys the same
token would read as a chain. Each group names where its fed tokens' keys are stored (`path`: the
storage slot, counted from the cached length, of the key at each position past it), so a tree node's
keys are read as its chain's are, with nothing copied. That is what makes a tree node's scores equal
its chain's bit for bit.

Everything here is host-side bookkeeping in numpy; `GroupTensors` is what kernels read.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ...common.protocol.tree import feed_depths
from .base import Feed


@dataclass
class HostPass:
    """One pass planned on the host: per packed token and per group, plain integer arrays."""

    ids: np.ndarray  # [T]
    positions: np.ndarray  # [T] each token's position in its session
    write_rows: np.ndarray  # [T] pool row its key and value go to
    q_start: np.ndarray  # [G] first packed token of each group's queries
    q_count: np.ndarray  # [G]
    past: np.ndarray  # [G] cached tokens before the pass (they are read in place)
    kv_len: np.ndarray  # [G] positions the group's queries read at most (past + its path)
    paths: list[np.ndarray]  # per group: storage slot past `past` of the key at each fed position
    tables: list[Sequence[int]]  # per group: its session's pages
    feed_rows: list[slice]  # per feed: its tokens in the packed order

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def groups(self) -> int:
        return len(self.q_start)

    @property
    def max_queries(self) -> int:
        return int(self.q_count.max())

    @property
    def max_path(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def max_pages(self) -> int:
        return max(len(t) for t in self.tables)


def lay_out(feeds: Sequence[Feed], page_tokens: int) -> HostPass:
    """Lay `feeds` out (their sequences already have room for their tokens)."""
    ids: list[int] = []
    positions, write_rows = [], []
    q_start, q_count, past, kv_len, paths, tables, feed_rows = [], [], [], [], [], [], []
    for feed in feeds:
        cached, n, start = feed.kv.length, len(feed.tokens), len(ids)
        if n == 0:
            raise ValueError("every feed needs at least one token")
        pages = feed.kv.pages
        slots = np.arange(cached, cached + n)
        page_of = np.asarray(pages, dtype=np.int64)[slots // page_tokens]
        write_rows.append(page_of * page_tokens + slots % page_tokens)
        ids += feed.tokens
        feed_rows.append(slice(start, start + n))
        if feed.parents is None:
            positions.append(slots)
            q_start.append(start), q_count.append(n), past.append(cached), kv_len.append(cached + n)
            paths.append(np.arange(n)), tables.append(pages)
            continue
        depths = feed_depths(feed.parents)
        positions.append(cached + np.asarray(depths))
        node_paths: list[list[int]] = []
        for j, parent in enumerate(feed.parents):
            node_paths.append((node_paths[parent] if parent >= 0 else []) + [j])
            q_start.append(start + j), q_count.append(1), past.append(cached)
            kv_len.append(cached + len(node_paths[j]))
            paths.append(np.asarray(node_paths[j])), tables.append(pages)
    as_int = lambda values: np.asarray(values, dtype=np.int64)  # noqa: E731
    return HostPass(as_int(ids), np.concatenate(positions).astype(np.int64), np.concatenate(write_rows),
                    as_int(q_start), as_int(q_count), as_int(past), as_int(kv_len), paths, tables, feed_rows)


@dataclass
class GroupTensors:
    """The attention groups as the kernels read them (one device; int32 unless said)."""

    positions: torch.Tensor  # [T] int64, each packed token's position (its queries see keys up to it)
    q_start: torch.Tensor  # [G]
    q_count: torch.Tensor  # [G] 0 for a padding group
    past: torch.Tensor  # [G]
    kv_len: torch.Tensor  # [G]
    path: torch.Tensor  # [G, P]
    tables: torch.Tensor  # [G, pages]
    page_tokens: int
    max_queries: int  # the most queries of any group (launch sizes; a graph's is its cap)
    max_len: int  # the longest kv_len (loop bounds on the CPU)
    cache: dict = field(default_factory=dict)  # what a kernel backend derives once per pass and reuses per layer


ROWS = ("ids", "positions", "write_rows", "q_start", "q_count", "past", "kv_len")  # the rows of `ints`


def stage(host: HostPass, ints: np.ndarray, path: np.ndarray, tables: np.ndarray, scratch_row: int) -> None:
    """Write the host plan into padded arrays: `ints` [7, T'] (the ROWS; T' >= T tokens and groups),
    `path` [>= G, >= longest path] and `tables` [>= G, >= most pages]. Padding tokens write to
    `scratch_row` at position 0; padding groups have no queries. Only the rows of real groups are
    written in `path` and `tables`: the kernels read nothing else."""
    t, g = host.tokens, host.groups
    ints[0, :t], ints[1, :t], ints[2, :t] = host.ids, host.positions, host.write_rows
    ints[0:2, t:], ints[2, t:] = 0, scratch_row
    ints[3, :g], ints[4, :g], ints[5, :g], ints[6, :g] = host.q_start, host.q_count, host.past, host.kv_len
    ints[3:, g:] = 0
    for i, (steps, pages) in enumerate(zip(host.paths, host.tables)):
        path[i, :len(steps)] = steps
        tables[i, :len(pages)] = pages
