"""The replica's KV memory: allocated once, handed out to sessions in pages (docs/design.md §3).

All layers' keys (and values) live in one tensor of `pages × PAGE_TOKENS` token rows, allocated
when the replica starts, so memory is bounded by the configured token budget and never grows with
traffic. A session owns a `PageTable`: the pages holding its tokens in order. Extending a session
takes free pages; rejecting a draft suffix or rolling back a failed round is a length update; a
closed or evicted session gives its pages back. Nothing is ever concatenated or copied per round; a
session that starts from another's cached prefix gets copies of its rows in pages of its own.
"""
from __future__ import annotations

import torch

from ...common.protocol.errors import ResourceExhausted

PAGE_TOKENS = 16  # tokens per page: small enough to waste little, large enough to keep tables short


class KVPool:
    """Keys and values `[layers, rows, kv_heads, head_dim]` in pages of PAGE_TOKENS rows, plus a free list.

    One row past the pages is a scratch row: a pass padded to a fixed shape (a CUDA graph's) writes
    its padding tokens' keys there, where no session reads.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, tokens: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if tokens < PAGE_TOKENS:
            raise ValueError(f"the KV budget must hold at least one page of {PAGE_TOKENS} tokens, got {tokens}")
        self.pages = tokens // PAGE_TOKENS
        rows = self.pages * PAGE_TOKENS + 1
        self.scratch_row = rows - 1
        # torch.empty, not zeros: a row is only ever read after a pass has written it, and untouched
        # CPU memory stays virtual until then.
        self.keys = torch.empty(layers, rows, kv_heads, head_dim, dtype=dtype, device=device)
        self.values = torch.empty(layers, rows, kv_heads, head_dim, dtype=dtype, device=device)
        # A stack: the most recently freed pages are reused first, so a steady load keeps touching
        # the same (resident, cache-warm) memory instead of walking through the whole pool.
        self._free: list[int] = list(range(self.pages - 1, -1, -1))

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy every layer's keys and values of rows `src` to rows `dst` (overlap is safe)."""
        for store in (self.keys, self.values):
            store.index_copy_(1, dst, store.index_select(1, src))

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool can hold in all."""
        return self.pages * PAGE_TOKENS

    @property
    def free_pages(self) -> int:
        """Pages not owned by any session."""
        return len(self._free)

    @property
    def free_tokens(self) -> int:
        """Tokens that fit in the free pages."""
        return len(self._free) * PAGE_TOKENS

    def take(self, count: int) -> list[int]:
        """`count` free pages; ResourceExhausted (and nothing taken) if there are fewer."""
        if count > len(self._free):
            raise ResourceExhausted(f"the replica's KV cache is full ({self.capacity_tokens} tokens); retry later")
        return [self._free.pop() for _ in range(count)]

    def give_back(self, pages: list[int]) -> None:
        """Return pages to the free list."""
        self._free.extend(reversed(pages))


class PageTable:
    """The pages holding one session's cached tokens, and how many tokens are stored."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.pages: list[int] = []
        self.length = 0  # tokens whose keys and values are stored

    def pages_needed(self, extra: int) -> int:
        """Pages to take before `extra` more tokens fit."""
        return max(0, -(-(self.length + extra) // PAGE_TOKENS) - len(self.pages))

    def grow(self, extra: int) -> None:
        """Make room for `extra` more tokens (the caller frees pages first if it must)."""
        if needed := self.pages_needed(extra):
            self.pages += self.pool.take(needed)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens; pages past them go back to the pool."""
        if length > self.length:
            raise ValueError(f"cannot truncate {self.length} cached tokens to {length}")
        self.length = length
        keep = -(-length // PAGE_TOKENS)
        if keep < len(self.pages):
            self.pool.give_back(self.pages[keep:])
            del self.pages[keep:]

    def release(self) -> None:
        """Give every page back (the session is gone)."""
        self.truncate(0)

    def copy_prefix(self, src: PageTable, length: int) -> None:
        """Start this empty table from `src`'s first `length` tokens: pages of its own (ResourceExhausted,
        nothing taken, if the pool lacks them) holding copies of their keys and values."""
        if self.length or self.pages:
            raise ValueError("a prefix is copied into an empty table only")
        if not 0 < length <= src.length:
            raise ValueError(f"cannot copy {length} tokens of a table of {src.length}")
        self.grow(length)
        device = self.pool.keys.device
        self.pool.move_rows(self.rows(length, device), src.rows(length, device))
        self.length = length

    def rows(self, stop: int, device: torch.device) -> torch.Tensor:
        """Pool row index of each of the tokens 0..stop-1, as a 1-D int64 tensor."""
        position = torch.arange(stop, device=device)
        pages = torch.tensor(self.pages, dtype=torch.long, device=device)
        return pages[position // PAGE_TOKENS] * PAGE_TOKENS + position % PAGE_TOKENS
