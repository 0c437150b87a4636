"""Collects verification rounds that arrive close together into one batched call (no tensors here).

A round waits at most `max_wait_ms` after the oldest queued round arrived, or until `max_batch`
rounds are queued; then the batch is verified in a worker thread while new rounds queue up for the
next one. So under load the verifier is never idle and batches grow by themselves, and a lone
round waits at most `max_wait_ms`. `max_batch` 1 turns batching off.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..common.errors import HybridSpecError, Unavailable
from ..common.wire import DraftBlock, VerifyResult

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

    async def submit(self, block: DraftBlock) -> VerifyResult:
        """Verify one round; its verify_ms includes the time it queued."""
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
            try:
                results = await asyncio.to_thread(self._verify_batch, [i.block for i in batch])
            except Exception as exc:  # a bug or a dead device: fail this batch, keep serving
                results = [exc] * len(batch)
            done = time.perf_counter()
            for item, result in zip(batch, results):
                if item.future.done():
                    continue  # the caller went away
                if isinstance(result, VerifyResult):
                    result = replace(result, verify_ms=(done - item.arrived) * 1e3)
                if isinstance(result, BaseException) and not isinstance(result, HybridSpecError):
                    item.future.set_exception(result)
                else:
                    item.future.set_result(result)
