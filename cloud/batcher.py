"""Collects verification rounds that arrive close together into one batched call (no tensors here).

A round waits at most `max_wait_ms` after the oldest queued round arrived, or until `max_batch`
rounds are queued; then the batch is verified in a worker thread while new rounds queue up for the
next one. So under load the verifier is never idle and batches grow by themselves, and a lone
round waits at most `max_wait_ms`. `max_batch` 1 turns batching off.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..common.errors import HybridSpecError, Unavailable, incident
from ..common.wire import DraftBlock, VerifyResult

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 16  # rounds scored in one forward pass at most
DEFAULT_MAX_WAIT_MS = 2.0  # how long a lone round waits for company

VerifyBatch = Callable[[Sequence[DraftBlock]], list[VerifyResult | HybridSpecError]]


@dataclass
class _Pending:
    block: DraftBlock
    future: asyncio.Future
    arrived: float


class RoundBatcher:
    """Queues rounds on the running event loop and feeds them to `verify_batch` in batches."""

    def __init__(self, verify_batch: VerifyBatch, max_batch: int, max_wait_ms: float) -> None:
        if max_batch < 1 or max_wait_ms < 0:
            raise ValueError(f"max_batch must be >= 1 and max_wait_ms >= 0, got {max_batch}, {max_wait_ms}")
        self._verify_batch = verify_batch
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1e3
        self._queue: list[_Pending] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        # A thread of its own: prefills and other blocking calls can never hold up the next batch.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="verify-batch")

    async def submit(self, block: DraftBlock) -> VerifyResult:
        """Verify one round; its verify_ms includes the time it queued (queue_ms)."""
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        item = _Pending(block, asyncio.get_running_loop().create_future(), time.perf_counter())
        self._queue.append(item)
        self._wake.set()
        result = await item.future
        if isinstance(result, HybridSpecError):
            raise result
        return result

    async def close(self) -> None:
        """Stop the batching task; rounds still queued fail with Unavailable."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for item in self._queue:
            if not item.future.done():
                item.future.set_result(Unavailable("the verifier is shutting down"))
        self._queue = []
        self._thread.shutdown(wait=False)

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
            # 1. Wait for company, up to max_wait after the oldest round arrived.
            while len(self._queue) < self.max_batch:
                left = self._queue[0].arrived + self.max_wait_s - time.perf_counter()
                if left <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except asyncio.TimeoutError:
                    break
            # 2. Take up to max_batch rounds of distinct sessions; a second round of a session waits.
            batch, rest, sessions = [], [], set()
            for item in self._queue:
                if len(batch) < self.max_batch and item.block.session_id not in sessions and not item.future.done():
                    batch.append(item)
                    sessions.add(item.block.session_id)
                elif not item.future.done():
                    rest.append(item)
            self._queue = rest
            if not batch:
                continue
            # 3. Verify off the event loop so new rounds keep queueing meanwhile.
            loop = asyncio.get_running_loop()
            try:
                results = await loop.run_in_executor(self._thread, self._verify_batch, [i.block for i in batch])
            except Exception as exc:  # a bug the verifier did not contain: fail this batch, keep serving
                results = [incident(log, exc, "a verification batch")] * len(batch)
            done = time.perf_counter()
            for item, result in zip(batch, results):
                if item.future.done():
                    continue  # the caller went away
                if isinstance(result, VerifyResult):
                    # The verifier reported its forward time; the rest of the wait was queueing.
                    total_ms = (done - item.arrived) * 1e3
                    result = replace(result, verify_ms=total_ms, queue_ms=max(0.0, total_ms - result.verify_ms))
                item.future.set_result(result)
