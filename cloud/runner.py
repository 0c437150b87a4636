"""One Verifier driven from an event loop: what a Ray replica and the in-process backend both run.

Rounds go through the batcher (its own thread); prefills run on a small pool of their own, so a
queue of long prompts never takes the thread a batch needs, and their chunks interleave with the
rounds (cloud/modellock.py). Any exception that is not a domain error becomes an Internal error
carrying a logged incident id: a caller only ever sees a HybridSpecError.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ..common.errors import HybridSpecError, incident
from ..common.wire import DraftBlock, SessionSpec, VerifyResult
from .batcher import RoundBatcher
from .verifier import Verifier, VerifierStats

log = logging.getLogger(__name__)
PREFILL_THREADS = 4  # concurrent opens per replica; their chunks take turns on the model
T = TypeVar("T")


class VerifierRunner:
    """Async face of one Verifier."""

    def __init__(self, verifier: Verifier, max_batch: int, max_wait_ms: float) -> None:
        self.verifier = verifier
        self._batcher = RoundBatcher(verifier.verify_batch, max_batch, max_wait_ms)
        self._prefill = ThreadPoolExecutor(PREFILL_THREADS, thread_name_prefix="prefill")
        self._admin = ThreadPoolExecutor(1, thread_name_prefix="verifier-admin")  # close, stats

    async def open_session(self, spec: SessionSpec) -> int:
        """Open or re-open a session; returns its committed length."""
        return await self._run(self._prefill, "OpenSession", self.verifier.open_session, spec)

    async def verify(self, block: DraftBlock) -> VerifyResult:
        """Verify one round in the next batch."""
        return await self._batcher.submit(block)

    async def close_session(self, session_id: str) -> bool:
        """Free a session; True if it existed."""
        return await self._run(self._admin, "CloseSession", self.verifier.close_session, session_id)

    async def stats(self) -> VerifierStats:
        """Sessions, cached tokens, evictions, held ids."""
        return await self._run(self._admin, "stats", self.verifier.stats)

    async def stop(self) -> None:
        """Fail queued rounds with Unavailable and let the threads go."""
        await self._batcher.close()
        self._prefill.shutdown(wait=False, cancel_futures=True)
        self._admin.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    async def _run(pool: ThreadPoolExecutor, what: str, fn: Callable[..., T], *args) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        except HybridSpecError:
            raise
        except Exception as exc:
            raise incident(log, exc, what) from None
