"""Per-session verifier state and the store that bounds it (docs/design.md §3).

The KV cache is a soft cache: the store drops sessions that sit idle too long, and evicts the least
recently used ones when the cached tokens of all sessions exceed a budget. A dropped session's next
round gets FAILED_PRECONDITION and the edge re-opens it from the committed tokens it holds. The
session count itself is a hard limit: past it, new sessions get RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from transformers import DynamicCache

from ..common.errors import FailedPrecondition, ResourceExhausted
from ..common.wire import DraftBlock, SessionSpec, VerifyResult


@dataclass
class Session:
    """One generation's state on the replica that owns it."""

    spec: SessionSpec
    committed: list[int]  # prompt + every committed token
    cache: DynamicCache  # the target's KV for committed[:-1]; the last token is fed with the next draft
    next_round: int
    last_block: DraftBlock | None = None  # the last answered block: only this exact block is a replay
    last_result: VerifyResult | None = None  # replayed verbatim when last_block comes again
    last_used: float = field(default_factory=time.monotonic)


class SessionStore:
    """Sessions by id, least recently used first."""

    def __init__(self, max_sessions: int, idle_timeout_s: float, max_cached_tokens: int = 0) -> None:
        """max_cached_tokens: LRU sessions are evicted while all sessions together hold more; 0 = no cap."""
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.max_cached_tokens = max_cached_tokens
        self.evictions = 0  # sessions dropped for idleness or the token budget, not by CloseSession
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._evicted: OrderedDict[str, None] = OrderedDict()  # recent evictions, to say so in errors

    def __len__(self) -> int:
        return len(self._sessions)

    def ids(self) -> tuple[str, ...]:
        """The ids of the sessions held now."""
        return tuple(self._sessions)

    @property
    def cached_tokens(self) -> int:
        """Committed tokens held by all sessions (a proxy for KV memory)."""
        return sum(len(s.committed) for s in self._sessions.values())

    def get(self, session_id: str) -> Session:
        """The live session, marked as just used; FailedPrecondition if unknown or evicted."""
        self.expire_idle()
        session = self._sessions.get(session_id)
        if session is None:
            why = "was evicted" if session_id in self._evicted else "is unknown"
            raise FailedPrecondition(f"the session {why} on this replica; re-open it")
        session.last_used = time.monotonic()
        self._sessions.move_to_end(session_id)
        return session

    def reserve(self, session_id: str) -> None:
        """Check there is room for `session_id` (a re-open of a live session always fits)."""
        self.expire_idle()
        if session_id not in self._sessions and len(self._sessions) >= self.max_sessions:
            raise ResourceExhausted(f"this replica already holds {self.max_sessions} sessions; retry later")

    def put(self, session: Session) -> None:
        """Insert or replace a session (call reserve first), then enforce the token budget."""
        self._sessions[session.spec.session_id] = session
        self._sessions.move_to_end(session.spec.session_id)
        self.enforce_budget(keep=session.spec.session_id)

    def pop(self, session_id: str) -> bool:
        """Drop a session; True if it existed."""
        return self._sessions.pop(session_id, None) is not None

    def enforce_budget(self, keep: str) -> int:
        """Evict least recently used sessions (never `keep`) while over the token budget."""
        if not self.max_cached_tokens:
            return 0
        evicted = 0
        total = self.cached_tokens
        for sid in list(self._sessions):
            if total <= self.max_cached_tokens:
                break
            if sid == keep:
                continue
            total -= len(self._sessions[sid].committed)
            self._evict(sid)
            evicted += 1
        return evicted

    def expire_idle(self) -> int:
        """Drop sessions idle longer than the timeout; returns how many."""
        deadline = time.monotonic() - self.idle_timeout_s
        stale = [sid for sid, s in self._sessions.items() if s.last_used < deadline]
        for sid in stale:
            self._evict(sid)
        return len(stale)

    def _evict(self, session_id: str) -> None:
        del self._sessions[session_id]
        self.evictions += 1
        self._evicted[session_id] = None
        while len(self._evicted) > 4096:
            self._evicted.popitem(last=False)
