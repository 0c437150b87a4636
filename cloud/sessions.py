"""Per-session verifier state and the store that bounds it (design brief §3)."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from transformers import DynamicCache

from ..common.errors import FailedPrecondition, ResourceExhausted
from ..common.wire import SessionSpec, VerifyResult


@dataclass
class Session:
    """One generation's state on the replica that owns it."""

    spec: SessionSpec
    committed: list[int]  # prompt + every committed token
    cache: DynamicCache  # the target's KV for committed[:-1]; the last token is fed with the next draft
    next_round: int
    last_result: VerifyResult | None = None  # replayed verbatim when round next_round - 1 comes again
    last_used: float = field(default_factory=time.monotonic)


class SessionStore:
    """Sessions by id, least recently used first; expires idle ones and refuses past capacity."""

    def __init__(self, max_sessions: int, idle_timeout_s: float) -> None:
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session:
        """The live session, marked as just used; FailedPrecondition if unknown or expired."""
        self.expire_idle()
        session = self._sessions.get(session_id)
        if session is None:
            raise FailedPrecondition(f"session {session_id!r} is unknown or was evicted; re-open it")
        session.last_used = time.monotonic()
        self._sessions.move_to_end(session_id)
        return session

    def reserve(self, session_id: str) -> None:
        """Check there is room for `session_id` (a re-open of a live session always fits)."""
        self.expire_idle()
        if session_id not in self._sessions and len(self._sessions) >= self.max_sessions:
            raise ResourceExhausted(f"this verifier already holds {self.max_sessions} sessions; retry later")

    def put(self, session: Session) -> None:
        """Insert or replace a session (call reserve first)."""
        self._sessions[session.spec.session_id] = session
        self._sessions.move_to_end(session.spec.session_id)

    def pop(self, session_id: str) -> bool:
        """Drop a session; True if it existed."""
        return self._sessions.pop(session_id, None) is not None

    def expire_idle(self) -> int:
        """Drop sessions idle longer than the timeout; returns how many."""
        deadline = time.monotonic() - self.idle_timeout_s
        stale = [sid for sid, s in self._sessions.items() if s.last_used < deadline]
        for sid in stale:
            del self._sessions[sid]
        return len(stale)
