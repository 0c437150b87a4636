"""A prompt prefix computed once: which cached tokens a new session may start from (engine-agnostic).

Chat sessions start with the same system prompt and template, and a conversation's next turn starts
with the whole of its last one. A new session whose prompt begins with tokens another session already
cached starts from a copy of their keys and values (`Engine.copy_prefix`) and prefills only the rest.
The sources are every live session of the replica and, kept here, the caches of sessions that closed
recently, up to `budget` tokens, least recently used out first (and first out whenever the replica
needs room: a live session's cache always comes before a closed one's). The copy is exact: an engine
caches a token's keys and values as a function of the tokens up to it, however they were fed, so the
new session scores exactly as if it had prefilled its whole prompt (tests/test_prefixes.py).

Who may start from whose tokens is a scope (cloud/core/limits.py PrefixScope). A cache shared across tenants
is a timing side channel (a hit answers sooner, telling one tenant what another's prompt began with:
vLLM's CVE-2025-46570 and its cache_salt), so by default a session reuses only what sessions of its own
identity computed; anonymous callers of a server without credentials are one identity, as they share
everything else. Sharing across identities is the operator's setting, never a client's choice, and the
counts here are only the operator's: no reply tells a client whether its prompt hit.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..engine.base import KVSequence
from .limits import PrefixScope

MIN_PREFIX_TOKENS = 16  # a shorter common prefix (the chat template's first line) is prefilled again


@dataclass(frozen=True)
class PrefixStats:
    """The prefix cache's counters since the replica started, and what it keeps now."""

    lookups: int = 0  # opens that looked for a prefix
    hits: int = 0  # opens that started from one
    tokens_saved: int = 0  # prompt tokens those opens did not prefill
    kept_sessions: int = 0  # closed sessions' caches kept now
    kept_tokens: int = 0  # tokens they hold


@dataclass
class _Kept:
    tokens: np.ndarray  # the closed session's cached tokens, int64
    kv: KVSequence
    scope: str


@dataclass(frozen=True)
class Source:
    """A cache a new session may copy from: whose it is, and the tokens it holds."""

    tokens: Sequence[int]  # at least the cached ones; only the first kv.length count
    kv: KVSequence
    owner: str


class PrefixCache:
    """Closed sessions' caches kept for reuse, and the choice of the longest cached prefix."""

    def __init__(self, scope: PrefixScope, budget: int, release: Callable[[KVSequence], None]) -> None:
        """budget: tokens of closed sessions' caches kept at most; release: gives a cache back to the engine."""
        self.scope = scope
        self.budget = budget
        self._release = release
        self._kept: OrderedDict[int, _Kept] = OrderedDict()  # by id(kv), least recently used first
        self._tokens = 0
        self._lookups = self._hits = self._saved = 0

    def key(self, owner: str) -> str:
        """The scope a session of `owner` reads and writes."""
        return "" if self.scope is PrefixScope.SHARED else owner

    def keep(self, tokens: Sequence[int], kv: KVSequence, owner: str) -> None:
        """Take a closing session's cache (`tokens` holds at least its cached ones), or release it when
        reuse is off, it is too short, or it is longer than the whole budget."""
        length = kv.length
        if self.scope is PrefixScope.OFF or length < MIN_PREFIX_TOKENS or length > self.budget:
            self._release(kv)
            return
        self._kept[id(kv)] = _Kept(np.asarray(tokens[:length], dtype=np.int64), kv, self.key(owner))
        self._tokens += length
        while self._tokens > self.budget:
            self.drop_oldest()

    def find(self, prompt: Sequence[int], owner: str, live: Iterable[Source]) -> tuple[KVSequence, int] | None:
        """The cache holding the longest prefix of `prompt` (the tokens a new session must cache) in
        `owner`'s scope, among `live` sessions' and the kept ones, and that prefix's length; None when
        none holds MIN_PREFIX_TOKENS or more. A kept cache found becomes the most recently used."""
        if self.scope is PrefixScope.OFF or len(prompt) < MIN_PREFIX_TOKENS:
            return None
        self._lookups += 1
        scope, wanted = self.key(owner), np.asarray(prompt, dtype=np.int64)
        candidates = [(s.tokens, s.kv) for s in live if self.key(s.owner) == scope]
        candidates += [(kept.tokens, kept.kv) for kept in self._kept.values() if kept.scope == scope]
        best, most = None, 0
        for tokens, kv in candidates:
            if kv.length > most and (n := _common(wanted, tokens, kv.length)) > most:
                best, most = kv, n
        if best is None or most < MIN_PREFIX_TOKENS:
            return None
        if id(best) in self._kept:
            self._kept.move_to_end(id(best))
        return best, most

    def hit(self, tokens: int) -> None:
        """A new session started from `tokens` cached tokens."""
        self._hits += 1
        self._saved += tokens

    def drop_oldest(self, spare: KVSequence | None = None) -> bool:
        """Release the least recently used kept cache (never `spare`); False if there is none to drop."""
        victim = next((key for key, kept in self._kept.items() if kept.kv is not spare), None)
        if victim is None:
            return False
        kept = self._kept.pop(victim)
        self._tokens -= len(kept.tokens)
        self._release(kept.kv)
        return True

    def clear(self) -> None:
        """Release every kept cache."""
        while self.drop_oldest():
            pass

    def stats(self) -> PrefixStats:
        """Counters and what is kept now."""
        return PrefixStats(self._lookups, self._hits, self._saved, len(self._kept), self._tokens)


def _common(wanted: np.ndarray, tokens: Sequence[int], length: int) -> int:
    """How many leading tokens `wanted` shares with `tokens[:length]`."""
    n = min(len(wanted), length)
    if n == 0 or wanted[0] != tokens[0]:
        return 0
    differ = np.flatnonzero(wanted[:n] != np.asarray(tokens[:n], dtype=np.int64))
    return int(differ[0]) if differ.size else n
