"""Who uses the replica's model next: verification rounds first, then prefill chunks in arrival order.

A plain lock lets whichever thread wakes first take the model, so a client that re-queues prefill
chunks back to back could keep the rounds of every other session waiting. This lock hands the model
over explicitly: to the oldest waiting round if there is one, else to the oldest prefill chunk. A
round therefore never waits longer than the chunk that is running when it arrives.
"""
from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator


class ModelLock:
    """A lock with two FIFO queues; release hands ownership straight to the next waiter."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self._rounds: deque[threading.Event] = deque()
        self._prefills: deque[threading.Event] = deque()

    def for_rounds(self) -> contextlib.AbstractContextManager[None]:
        """Hold the model for verification rounds (served before waiting prefill chunks)."""
        return self._hold(self._rounds)

    def for_prefill(self) -> contextlib.AbstractContextManager[None]:
        """Hold the model for one prefill chunk (or any other short, deferrable work)."""
        return self._hold(self._prefills)

    @contextlib.contextmanager
    def _hold(self, queue: deque[threading.Event]) -> Iterator[None]:
        self._acquire(queue)
        try:
            yield
        finally:
            self._release()

    def _acquire(self, queue: deque[threading.Event]) -> None:
        with self._mutex:
            if not self._held:
                self._held = True
                return
            turn = threading.Event()
            queue.append(turn)
        turn.wait()  # the releasing thread handed the model to us; _held stayed True

    def _release(self) -> None:
        with self._mutex:
            queue = self._rounds or self._prefills
            if queue:
                queue.popleft().set()
            else:
                self._held = False
