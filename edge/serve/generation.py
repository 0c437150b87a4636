"""One request's generation on a worker thread, its text handed to the event loop through a queue.

The worker's loop is blocking code (drafter forward passes, gRPC waits), so each generation runs on
one of anyio's worker threads, at most `max_concurrent` at once (limits.Admission). The thread puts
`Text` items (newly final text), `Progress` items (the cloud's word on a long prompt's prefill) and,
last, one `Outcome` on an asyncio queue; the request's
coroutine awaits them. Cancelling a job (the client went away) stops its generation after the
event in hand and closes its cloud session.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from ..config import EdgeConfig
from ..prompt import codec_messages
from ..generation import EventKind, Generation
from ..worker import EdgeWorker


@dataclass(frozen=True)
class Text:
    """Text that became final: no later event changes it."""

    text: str


@dataclass(frozen=True)
class Progress:
    """The cloud has cached `cached` of the prompt's `total` tokens (it reports at least every 2 s)."""

    cached: int
    total: int


@dataclass(frozen=True)
class Outcome:
    """How the generation ended: `error` is what it raised, `cancelled` whether the client went away;
    `generation`, ended, holds what was committed either way (None: it never started)."""

    generation: Generation | None
    error: BaseException | None = None
    cancelled: bool = False


class Job:
    """One generation: `start` it, `await next()` until an Outcome arrives, or `cancel()` it."""

    def __init__(self, worker: EdgeWorker, prompt_ids: list[int], config: EdgeConfig,
                 limiter: anyio.CapacityLimiter, on_thread: Callable[[int], None]) -> None:
        """on_thread(+1 / -1): the generation starts or stops running on a thread (the metrics' gauge)."""
        self.worker = worker
        self.prompt_ids = prompt_ids
        self.config = config
        self.limiter = limiter
        self.on_thread = on_thread
        self.created = time.perf_counter()
        self.first_text_at: float | None = None
        self.ended_at: float | None = None
        self.outcome: Outcome | None = None  # set by the thread; None if the job never got one
        self._queue: asyncio.Queue[Text | Progress | Outcome] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._cancelled = threading.Event()
        self._started = threading.Event()
        self._task: asyncio.Task | None = None
        self._sent = ""  # the text put so far

    @property
    def ttft_s(self) -> float | None:
        """Seconds from the request to the first final text (None: no text yet)."""
        return None if self.first_text_at is None else self.first_text_at - self.created

    def itl_s(self, tokens: int) -> float | None:
        """Mean seconds between the generation's output tokens after the first, for `tokens` output
        tokens (None: fewer than two, or no text)."""
        if self.first_text_at is None or self.ended_at is None or tokens < 2:
            return None
        return (self.ended_at - self.first_text_at) / (tokens - 1)

    def start(self, on_done: Callable[[Job], None]) -> None:
        """Queue the generation for a worker thread; `on_done(job)` runs on the event loop once the
        thread is done with it, or once it was cancelled before it got a thread."""
        def done(task: asyncio.Task) -> None:
            if not task.cancelled():
                task.exception()  # _run catches everything; this only marks the result as seen
            on_done(self)

        self._task = asyncio.ensure_future(anyio.to_thread.run_sync(self._run, limiter=self.limiter))
        self._task.add_done_callback(done)

    async def next(self) -> Text | Progress | Outcome:
        """The next item; after an Outcome there are none."""
        return await self._queue.get()

    def cancel(self) -> None:
        """Stop the generation (a no-op once it ended)."""
        self._cancelled.set()
        if self._task is not None and not self._started.is_set():
            self._task.cancel()  # still waiting for a thread: it never starts (a running one sees the flag)

    def _run(self) -> None:
        self._started.set()
        if self._cancelled.is_set():
            return self._end(Outcome(None, cancelled=True))
        self.on_thread(+1)
        generation = None
        try:
            generation = self.worker.stream(self.prompt_ids, config=self.config)
            events = iter(generation)
            for event in events:
                if self._cancelled.is_set():
                    events.close()  # its cleanup closes the cloud session and counts what it did
                    return self._end(Outcome(generation, cancelled=True))
                if event.kind is EventKind.COMMIT and event.text:
                    self._text(event.text)
                elif event.kind is EventKind.PROGRESS:
                    self._put(Progress(*event.progress))
            self._text_after_commits(generation)
            self._end(Outcome(generation))
        except Exception as exc:  # noqa: BLE001 — the request's coroutine turns it into the client's error
            self._end(Outcome(generation, exc))
        finally:
            self.on_thread(-1)

    def _end(self, outcome: Outcome) -> None:
        self.ended_at = time.perf_counter()
        self.outcome = outcome
        self._put(outcome)

    def _text(self, text: str) -> None:
        if self.first_text_at is None:
            self.first_text_at = time.perf_counter()
        self._sent += text
        self._put(Text(text))

    def _text_after_commits(self, generation: Generation) -> None:
        """Text the generation ends with that no commit carried: the tail drafted while the cloud was
        away and never verified (allow_unverified)."""
        if generation.text.startswith(self._sent) and len(generation.text) > len(self._sent):
            self._text(generation.text[len(self._sent):])

    def _put(self, item: Text | Progress | Outcome) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is closed: the server is shutting down and nobody is listening


def warm_up(worker: EdgeWorker, tokens: int) -> float:
    """One short chat generation, so that the first request finds the drafter's kernels, the gRPC
    channel, the chat template and the worker's measurements (the phase decision's warm-up) ready.
    Returns the seconds it took."""
    start = time.perf_counter()
    prompt = codec_messages(worker.codec, [{"role": "user", "content": "Say hello."}])
    for _ in worker.stream(prompt, config=worker.config.updated(max_new_tokens=tokens)):
        pass
    return time.perf_counter() - start
