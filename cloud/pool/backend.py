"""Replicas in this process: a pool over one Verifier, and what a replica's own endpoint serves.

`InProcessReplica` is the `Replica` (cloud/pool/pool.py) of a Verifier in the front door's process,
batched by the same Scheduler as a Ray replica's; `InProcessBackend` builds the pool over one (tests,
single-box use, and the baseline for the Ray hop's cost). `ReplicaEndpointBackend` is what a Ray
replica's direct endpoint serves (cloud/api/server.py): verify and decode straight to its scheduler.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from ...common.protocol.errors import Unavailable
from ...common.protocol.wire import DraftBlock, ModelInfo, SessionOpened, SessionSpec, VerifyResult
from ...common.security.credentials import Identity
from ..core.limits import DEFAULT_MAX_BATCH, DEFAULT_MAX_WAIT_MS, DEFAULT_PREFILL_BUDGET_MS
from ..core.scheduler import Scheduler
from ..core.telemetry import Tally
from ..core.verifier import Verifier, VerifierStats
from .pool import Pool


class InProcessReplica:
    """A Verifier in this process behind its own Scheduler (made at start: its thread, not the model,
    is what starting takes). It never dies on its own, and has no direct endpoint."""

    alive = True
    failures = 0
    verify_address = ""

    def __init__(self, verifier: Verifier, max_batch: int, max_wait_ms: float, prefill_budget_ms: float,
                 name: str = "in-process") -> None:
        self.name = name
        self.verifier = verifier
        self._batching = (max_batch, max_wait_ms, prefill_budget_ms)
        self._scheduler: Scheduler | None = None

    async def start(self) -> ModelInfo:
        """Start batching; the verifier came loaded."""
        self._scheduler = Scheduler(self.verifier, *self._batching)
        return self.verifier.info

    async def stop(self) -> None:
        """Stop batching."""
        if self._scheduler is not None:
            await self._scheduler.aclose()

    async def wait_alive(self) -> None:
        """Always alive."""

    async def open_session(self, spec: SessionSpec) -> SessionOpened:
        """Open or re-open a session in the next step."""
        return await self._live().open_session(spec)

    async def verify(self, block: DraftBlock) -> VerifyResult:
        """Verify one round in the next step."""
        return await self._live().verify(block)

    async def decode(self, block: DraftBlock, max_tokens: int, eos: frozenset[int]) -> AsyncIterator[int]:
        """Cloud-only decoding, each token as the model thread decodes it."""
        async for token in self._live().decode(block, max_tokens, eos):
            yield token

    async def close_session(self, session_id: str) -> bool:
        """Free a session."""
        return await self._live().close_session(session_id)

    async def stats(self) -> VerifierStats:
        """The verifier's stats, read between steps."""
        return await self._live().stats()

    async def take_tally(self) -> Tally:
        """Nothing: no direct endpoint."""
        return Tally()

    def _live(self) -> Scheduler:
        if self._scheduler is None:
            raise Unavailable("the verifier is not started")
        return self._scheduler


def InProcessBackend(verifier: Verifier, max_batch: int = DEFAULT_MAX_BATCH, max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
                     max_sessions_per_client: int | None = None, max_sessions_per_address: int | None = None,
                     prefill_budget_ms: float = DEFAULT_PREFILL_BUDGET_MS) -> Pool:
    """The pool over one Verifier in this process, with the same round batching as a Ray replica.
    Session limits left None: as many as the verifier holds. (Named as the class it replaced, so the
    CLI, the benchmarks and the tests build it as before.)"""
    most = verifier.limits.max_sessions
    return Pool([InProcessReplica(verifier, max_batch, max_wait_ms, prefill_budget_ms)],
                max_sessions_per_client or most, max_sessions_per_address or most, replica_wait_s=0.0)


class ReplicaEndpointBackend:
    """A replica's own scheduler, as its direct endpoint serves it (cloud/api/server.py): only
    `verify` and `decode`, of sessions this replica holds.

    Sessions reach that scheduler only through the front door, which issued their ids and routed them
    there; so no routing table is kept here: the verifier is the authority, answering
    FAILED_PRECONDITION for any id it does not hold, whoever presents it, and checking that the
    session is the caller's.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def model_info(self) -> ModelInfo:
        """What the replica serves."""
        return self.scheduler.verifier.info

    async def verify(self, block: DraftBlock, caller: Identity) -> VerifyResult:
        """Verify one round, sent by `caller`, of a session this replica holds."""
        return await self.scheduler.verify(replace(block, owner=caller.owner))

    async def decode(self, block: DraftBlock, max_tokens: int, eos: frozenset[int],
                     caller: Identity) -> AsyncIterator[int]:
        """Cloud-only decoding of a session this replica holds, straight from its scheduler."""
        async for token in self.scheduler.decode(replace(block, owner=caller.owner), max_tokens, eos):
            yield token
