"""Per-session verifier state and the store that bounds it (docs/design.md §3).

The KV cache is a soft cache: the store drops sessions that sit idle too long, and evicts the least
recently used ones when the replica's KV pool has no free pages for a step. A dropped session's next
round gets FAILED_PRECONDITION and the edge re-opens it from the committed tokens it holds. The
session count itself is a hard limit: past it, new sessions get RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ...common.protocol.errors import FailedPrecondition, ResourceExhausted
from ...common.protocol.wire import DraftBlock, SessionSpec, VerifyResult
from ..engine.kvpool import KVPool, PageTable


@dataclass
class Session:
    """One generation's state on the replica that owns it."""

    spec: SessionSpec
    committed: list[int]  # prompt + every committed token
    table: PageTable  # the target's KV for committed[:-1]; the last token is fed with the next draft
    next_round: int
    last_block: DraftBlock | None = None  # the last answered block: only this exact block is a replay
    last_result: VerifyResult | None = None  # replayed verbatim when last_block comes again
    last_used: float = field(default_factory=time.monotonic)
    opened_at: float = field(default_factory=time.monotonic)  # when the replica took its (re-)open
    answered_at: float = 0.0  # when its last round was answered; 0 = none since it was (re-)opened


class SessionStore:
    """Sessions by id, least recently used first."""

    def __init__(self, max_sessions: int, idle_timeout_s: float) -> None:
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
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
        """Insert or replace a session (call reserve first); a replaced session's pages are freed."""
        old = self._sessions.pop(session.spec.session_id, None)
        if old is not None:
            old.table.release()
        self._sessions[session.spec.session_id] = session

    def pop(self, session_id: str) -> bool:
        """Drop a session and free its pages; True if it existed."""
        session = self._sessions.pop(session_id, None)
        if session is not None:
            session.table.release()
        return session is not None

    def make_room(self, pool: KVPool, pages: int, keep: set[str]) -> None:
        """Evict least recently used sessions (never those in `keep`) until `pages` pages are free."""
        for sid in list(self._sessions):
            if pool.free_pages >= pages:
                return
            if sid not in keep:
                self._evict(sid)

    def expire_idle(self) -> int:
        """Drop sessions idle longer than the timeout; returns how many."""
        deadline = time.monotonic() - self.idle_timeout_s
        stale = [sid for sid, s in self._sessions.items() if s.last_used < deadline]
        for sid in stale:
            self._evict(sid)
        return len(stale)

    def _evict(self, session_id: str) -> None:
        self._sessions.pop(session_id).table.release()
        self.evictions += 1
        self._evicted[session_id] = None
        while len(self._evicted) > 4096:
            self._evicted.popitem(last=False)
