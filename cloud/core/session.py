"""One session's whole state on the replica that owns it, and the store that bounds how many it holds.

A `Session` is born PREFILLING when an OpenSession is admitted: its prompt is fed chunk by chunk and
nobody can send it rounds yet. Once the whole prompt is cached it becomes LIVE in the store (replacing
a session of the same id: a re-open). A session that cannot be opened is FAILED and keeps its error
for the caller. Everything that changes a session is a method here; the verifier only decides when.

The KV cache is a soft cache (docs/design.md §3): the store drops sessions that sit idle too long,
and evicts idle ones when the engine has no room for a pass: first those of the tenant (identity)
holding the most cells beyond its share of the cache, least recently used first, and never one of a
tenant within its share while another is over its own. A dropped session's next round gets
FAILED_PRECONDITION and the edge re-opens it from the committed tokens it holds. The session count
itself is a hard limit: past it, new sessions get RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import enum
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

from ...common.maths.features import join_blocks
from ...common.protocol.errors import FailedPrecondition, HybridSpecError, PermissionDenied, ResourceExhausted
from ...common.protocol.wire import DraftBlock, FeatureBlock, SessionOpened, SessionSpec, VerifyResult
from ..engine.base import KVSequence

REMEMBERED_EVICTIONS = 4096  # ids of recently evicted sessions, so their next round can say so
# When a full replica tells a client to retry (RetryInfo): a few rounds' time, in which busy sessions
# usually fall idle (then they may be parked or evicted) or end.
FULL_RETRY_S = 5.0


class Phase(enum.Enum):
    """Where a session stands."""

    PREFILLING = "prefilling"  # prompt chunks still to run; not visible to rounds
    LIVE = "live"  # its prompt is cached; it takes rounds
    FAILED = "failed"  # its open failed; the error is in `error`, its cache is released


class Session:
    """Everything about one generation on its replica: spec, committed ids, KV cache, round state."""

    def __init__(self, spec: SessionSpec, kv: KVSequence) -> None:
        self.spec = spec
        self.kv = kv  # the target's cache of committed[:-1]; the newest token is fed with the next block
        self.committed = list(spec.committed_ids)  # prompt + every committed token
        self.phase = Phase.PREFILLING
        self.error: HybridSpecError | None = None
        self.next_round = spec.next_round
        self.last_block: DraftBlock | None = None  # only this exact block is a replay
        self.last_result: VerifyResult | None = None  # replayed verbatim when last_block comes again
        self.prefill_features: list[FeatureBlock] = []  # asked-for features of the prompt chunks so far
        self.opened_at = self.last_used = time.monotonic()
        self.answered_at = 0.0  # when its last round was answered; 0 = none since it was (re-)opened
        self.looked_for_prefix = False  # whether its open has looked for a cached prefix to start from

    # ---- opening -------------------------------------------------------------------------------

    @property
    def remaining(self) -> int:
        """Prompt tokens still to cache (all committed tokens but the newest)."""
        return len(self.committed) - 1 - self.kv.length

    def next_chunk(self, budget: int) -> list[int]:
        """The next at most `budget` prompt tokens to feed."""
        start = self.kv.length
        return self.committed[start:start + min(budget, self.remaining)]

    def opened(self) -> SessionOpened:
        """The answer to the open: its length and the features of its context, if it asked."""
        features = join_blocks(self.prefill_features) if self.prefill_features else None
        return SessionOpened(self.spec.session_id, len(self.committed), features=features)

    def fail(self, error: HybridSpecError, release: Callable[[KVSequence], None]) -> None:
        """Give up an open: free its cache and keep the error for the caller."""
        release(self.kv)
        self.phase, self.error = Phase.FAILED, error

    # ---- rounds --------------------------------------------------------------------------------

    def admit(self, block: DraftBlock, max_context: int) -> bool:
        """Check a validated block against this session: True if it is the exact replay of the last
        answered round (answer with `last_result`), False if it is the next round; else raise the
        error it deserves (messages name only what the request said)."""
        if block.owner != self.spec.owner:
            raise PermissionDenied("this session belongs to another identity")
        if self.last_block is not None and block.round == self.next_round - 1:
            if block != self.last_block:
                raise FailedPrecondition(f"round {block.round} was already answered for a different block; "
                                         "send the next round")
            return True
        if block.round != self.next_round:
            raise FailedPrecondition(f"round {block.round} is not this session's next round")
        if block.committed_len != len(self.committed):
            raise FailedPrecondition(f"committed_len {block.committed_len} disagrees with this session's "
                                     "committed length")
        if len(self.committed) + len(block.draft_ids) + 1 > max_context:
            raise ResourceExhausted(f"the block would grow the session past max_context {max_context}")
        return False

    def round_tokens(self, block: DraftBlock) -> list[int]:
        """What a round feeds: the newest committed token, then the drafts."""
        return [self.committed[-1], *block.draft_ids]

    def commit(self, block: DraftBlock, accepted: list[int], result: VerifyResult) -> None:
        """Record an answered round: its accepted drafts and new token are committed for good."""
        self.committed += [*accepted, result.next_token]
        self.next_round = block.round + 1
        self.last_block, self.last_result = block, result

    def roll_back(self, truncate: Callable[[KVSequence, int], None]) -> None:
        """Cut the cache back to the committed tokens (all but the newest), after a failed round."""
        truncate(self.kv, min(self.kv.length, len(self.committed) - 1))


class SessionStore:
    """LIVE sessions by id, least recently used first."""

    def __init__(self, max_sessions: int, idle_timeout_s: float, release: Callable[[KVSequence], None],
                 retire: Callable[[Session], None] | None = None) -> None:
        """release: frees a dropped session's cache; retire: takes a closed session (default: release it)."""
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.evictions = 0  # sessions dropped for idleness or room in the cache, not by CloseSession
        self._release = release
        self._retire = retire or (lambda session: release(session.kv))
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._evicted: OrderedDict[str, None] = OrderedDict()  # recent evictions, to say so in errors

    def __len__(self) -> int:
        return len(self._sessions)

    def ids(self) -> tuple[str, ...]:
        """The ids of the sessions held now."""
        return tuple(self._sessions)

    def live(self) -> Iterable[Session]:
        """The sessions held now (do not change the store while iterating)."""
        return self._sessions.values()

    @property
    def cached_tokens(self) -> int:
        """Committed tokens held by all sessions (a proxy for KV memory)."""
        return sum(len(s.committed) for s in self._sessions.values())

    def find(self, session_id: str) -> Session | None:
        """The live session of that id, if any, changing nothing (not even its last use)."""
        return self._sessions.get(session_id)

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
            held = f"{self.max_sessions} session{'s' if self.max_sessions != 1 else ''}"
            raise ResourceExhausted(f"this replica already holds {held}, its limit; retry in about {FULL_RETRY_S:g} s",
                                    FULL_RETRY_S)

    def go_live(self, session: Session) -> None:
        """Make a fully prefilled session LIVE, replacing (and freeing) one of the same id; a session
        count filled meanwhile fails it instead."""
        try:
            self.reserve(session.spec.session_id)
        except HybridSpecError as exc:
            session.fail(exc, self._release)
            return
        old = self._sessions.pop(session.spec.session_id, None)
        if old is not None:
            self._release(old.kv)
        session.phase = Phase.LIVE
        session.last_used = time.monotonic()  # appended as the most recently used (see expire_idle)
        self._sessions[session.spec.session_id] = session

    def pop(self, session_id: str) -> bool:
        """Close a session, handing it to `retire`; True if it existed."""
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._retire(session)
        return session is not None

    def make_room(self, fits: Callable[[], bool], keep: Iterable[str], spare: KVSequence | None = None,
                  asker: Session | None = None, capacity: int = 0, running: Iterable[str] = ()) -> None:
        """Evict sessions until `fits()`: each time one of the tenant holding the most cells (committed
        tokens, resident or parked, with `asker`'s counted for its tenant) beyond its share (`capacity` ×
        its weight / the weights of the tenants holding sessions), least recently used first. Never one in
        `running` (the pass being planned), nor the one caching `spare`; one in `keep` (work queued) only
        when its tenant is over its share and the room is for a tenant within its own; and never one of a
        tenant within its share while another tenant is over its own, unless it is `asker`'s own tenant.
        Stops when nothing more may be evicted."""
        keep, running = set(keep), set(running)
        while not fits():
            held, weights = Counter(), {}
            for session in self._sessions.values():
                held[session.spec.tenant] += len(session.committed)
                weights[session.spec.tenant] = session.spec.weight
            if asker is not None:
                weights.setdefault(asker.spec.tenant, asker.spec.weight)
                if self._sessions.get(asker.spec.session_id) is not asker:  # an open: not held yet
                    held[asker.spec.tenant] += len(asker.committed)
            total = sum(weights.values())
            excess = {t: held[t] - capacity * w / total for t, w in weights.items()}
            under = asker is not None and excess[asker.spec.tenant] <= 0
            movable = [(sid, s) for sid, s in self._sessions.items() if sid not in running and s.kv is not spare
                       and (sid not in keep or (under and excess[s.spec.tenant] > 0))]
            if not movable:
                return
            # Least recently used first within a tenant: the store's order (min keeps the first of equals).
            sid, victim = min(movable, key=lambda item: -excess[item[1].spec.tenant])
            tenant = victim.spec.tenant
            if excess[tenant] <= 0 and any(e > 0 for e in excess.values()) and (asker is None
                                                                                 or tenant != asker.spec.tenant):
                return
            self._evict(sid)

    def expire_idle(self) -> int:
        """Drop sessions idle longer than the timeout; returns how many. The store is in order of last
        use (`get` moves a session to the end, `go_live` appends one), so only its stale head is read:
        every round's `get` asks, and a scan of every session would make a step quadratic."""
        deadline = time.monotonic() - self.idle_timeout_s
        stale = []
        for sid, session in self._sessions.items():
            if session.last_used >= deadline:
                break
            stale.append(sid)
        for sid in stale:
            self._evict(sid)
        return len(stale)

    def _evict(self, session_id: str) -> None:
        self._release(self._sessions.pop(session_id).kv)
        self.evictions += 1
        self._evicted[session_id] = None
        while len(self._evicted) > REMEMBERED_EVICTIONS:
            self._evicted.popitem(last=False)

