"""One Verifier driven from an event loop: what a Ray replica and the in-process backend both run.

All model work goes through the replica's scheduler (cloud/core/scheduler.py), one thread that runs the
forward passes; this class only turns its futures into awaitables. Any exception that is not a
domain error becomes an Internal error carrying a logged incident id: a caller only ever sees a
HybridSpecError.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future

from ...common.protocol.errors import HybridSpecError, incident
from ...common.protocol.wire import DraftBlock, SessionOpened, SessionSpec, VerifyResult
from .scheduler import DEFAULT_PREFILL_BUDGET_MS, Scheduler
from .verifier import Verifier, VerifierStats

log = logging.getLogger(__name__)


class VerifierRunner:
    """Async face of one Verifier."""

    def __init__(self, verifier: Verifier, max_batch: int, max_wait_ms: float,
                 prefill_budget_ms: float = DEFAULT_PREFILL_BUDGET_MS) -> None:
        self.verifier = verifier
        self._scheduler = Scheduler(verifier, max_batch, max_wait_ms, prefill_budget_ms)

    async def open_session(self, spec: SessionSpec) -> SessionOpened:
        """Open or re-open a session; returns its committed length and asked-for features.
        Cancelling abandons the open."""
        return await self._wait("OpenSession", self._scheduler.submit_open(spec))

    async def verify(self, block: DraftBlock) -> VerifyResult:
        """Verify one round in the next step."""
        return await self._wait("Verify", self._scheduler.submit_round(block))

    async def close_session(self, session_id: str) -> bool:
        """Free a session; True if it existed."""
        return await self._wait("CloseSession", self._scheduler.submit_call(
            lambda: self.verifier.close_session(session_id)))

    async def stats(self) -> VerifierStats:
        """Sessions, cached tokens, evictions, held ids, KV pool size."""
        return await self._wait("stats", self._scheduler.submit_call(self.verifier.stats))

    async def stop(self) -> None:
        """Fail queued work with Unavailable and let the model thread go."""
        await asyncio.get_running_loop().run_in_executor(None, self._scheduler.stop)

    @staticmethod
    async def _wait(what: str, future: Future):
        try:
            result = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:
            raise incident(log, exc, what) from None
        if isinstance(result, HybridSpecError):
            raise result
        return result
