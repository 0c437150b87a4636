"""Continuous batching: what each forward pass of a replica carries, and the thread that runs them
(no tensors here). `Scheduler.schedule` is the one place every scheduling rule is applied: it returns
the exact pass (cloud/core/passes.py `Pass`), which the verifier runs as given. The model thread loops
wait → schedule → step → answer, and callers on an event loop await the answers.

Every step carries the queued rounds (one per session, at most `max_batch` sessions, as many as one
pass of the engine may carry: the rest go first in the next step, without waiting for company) plus
a chunk of the prompts being opened, oldest first (cloud/core/verifier.py `step`). Rounds come first
because an edge is waiting on each one; a prompt advances at least every other step, so it is never
starved by them. Verify blocks and cloud-only decode steps (a block with no draft) are the same kind of work.

How long a chunk is depends on who is waiting. With nobody else active, a prompt is fed
`prefill_chunk` tokens a step, the most efficient size. While other sessions are sending rounds, a
step that carries their rounds carries no prompt, unless the step before carried none (so the prompt
still advances at least every other step), and a step of prompt alone is sized by time: its chunk
fills `prefill_budget_ms` at the cost per token measured on earlier prompt steps. A round then waits
behind at most about one budget, however long the prompt and however slow the machine
(`prefill_tokens`). The price is the prompt's: it advances in the gaps between rounds.

A lone round runs at once. Only while other sessions that sent rounds recently have none queued
does a round wait for their company, and then at most `max_wait_ms` from the moment the model is
free: under load the batch grows while the previous step runs, the sessions that step answered get
a moment to rejoin, and a single edge never pays a batching delay.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

from ...common.protocol.errors import HybridSpecError, Unavailable, incident
from ...common.protocol.wire import DraftBlock, SessionOpened, SessionSpec, VerifyResult
from .limits import DEFAULT_MAX_BATCH, DEFAULT_MAX_WAIT_MS, DEFAULT_PREFILL_BUDGET_MS
from .decoding import DecodeStream
from .passes import Pass, plan_pass
from .session import Phase, Session
from .verifier import Verifier, VerifierStats

log = logging.getLogger(__name__)

MIN_PREFILL_CHUNK = 4  # a prompt step always carries this much, however tight the budget
ACTIVE_WINDOW_S = 0.5  # a session that sent a round this recently is expected to send another
COST_SMOOTHING = 0.3  # weight of the newest step in the running cost per token


def prefill_tokens(budget_ms: float, ms_per_token: float | None, round_tokens: int, max_chunk: int,
                   others_waiting: bool, fed_last_step: bool) -> int:
    """How many prompt tokens a step may carry beside `round_tokens` tokens of rounds.

    Nobody else waiting: `max_chunk`. Otherwise none beside rounds if the last step fed the prompt,
    and else what the rounds leave of the budget at the measured cost per token, within
    [MIN_PREFILL_CHUNK, max_chunk]; before anything is measured, the least. The cost per token is a
    prompt step's time over its tokens, fixed per-step costs included, so on a slow machine (or deep
    in a long prompt, where each token attends to more) the chunk shrinks until a step fits the
    budget or reaches the floor.
    """
    if not others_waiting and round_tokens == 0:
        return max_chunk
    if round_tokens and fed_last_step:
        return 0
    floor = min(MIN_PREFILL_CHUNK, max_chunk)
    if ms_per_token is None:
        return floor
    return max(floor, min(max_chunk, int(budget_ms / ms_per_token) - round_tokens))


class StepCost:
    """The running cost of a step per token it feeds (ms), smoothed over the steps so far."""

    def __init__(self) -> None:
        self.ms_per_token: float | None = None

    def observe(self, seconds: float, tokens: int) -> None:
        """One step that fed `tokens` tokens took `seconds`."""
        if tokens <= 0:
            return
        sample = 1e3 * seconds / tokens
        previous = self.ms_per_token
        self.ms_per_token = sample if previous is None else previous + COST_SMOOTHING * (sample - previous)


@dataclass
class _Round:
    block: DraftBlock
    future: Future
    arrived: float
    stream: DecodeStream | None = None  # a cloud-only stream's round: its answer queues the next one


@dataclass
class _Open:
    spec: SessionSpec
    future: Future
    session: Session | None = None  # set once the scheduler thread has admitted it


@dataclass(frozen=True)
class Step:
    """One turn of the model thread, as `Scheduler.schedule` decided it: the bookkeeping calls, the
    queued rounds that `work` carries (in its order), every open in the queue (to settle after the
    step), and `work`, exactly the pass the verifier runs."""

    calls: list[tuple[Callable[[], object], Future]]
    rounds: list[_Round]
    opens: list[_Open]
    work: Pass


class Scheduler:
    """Owns the model thread of one Verifier; callers get futures, or await the async methods."""

    def __init__(self, verifier: Verifier, max_batch: int = DEFAULT_MAX_BATCH,
                 max_wait_ms: float = DEFAULT_MAX_WAIT_MS, prefill_budget_ms: float = DEFAULT_PREFILL_BUDGET_MS) -> None:
        if max_batch < 1 or max_wait_ms < 0 or not prefill_budget_ms > 0:
            raise ValueError(f"max_batch must be >= 1, max_wait_ms >= 0 and prefill_budget_ms > 0, got {max_batch}, "
                             f"{max_wait_ms}, {prefill_budget_ms}")
        self.verifier = verifier
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1e3
        self.prefill_budget_ms = prefill_budget_ms
        self.cost = StepCost()  # of the steps that fed a prompt
        self._fed_last_step = False
        self._split = False  # the last step left rounds for the engine's limits
        self._cv = threading.Condition()
        # The queues are made once and only ever changed in place, under the lock: a submitter is
        # handed the queue object before it takes the lock, so swapping in a new queue would drop
        # its item into the old one, never to be answered.
        self._rounds: deque[_Round] = deque()
        self._opens: deque[_Open] = deque()
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()
        self._recent: dict[str, float] = {}  # session -> when its last round arrived
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="verifier-steps", daemon=True)
        self._thread.start()

    # ---- submitting work (any thread) ----------------------------------------------------------

    def submit_round(self, block: DraftBlock) -> Future:
        """Verify one round in the next step; resolves to a VerifyResult or a HybridSpecError."""
        return self._put(self._rounds, _Round(block, Future(), time.perf_counter()))

    def submit_open(self, spec: SessionSpec) -> Future:
        """Open a session; resolves to its SessionOpened (length, asked-for features) or a
        HybridSpecError. Cancelling the future before it resolves abandons the open and frees what it holds."""
        return self._put(self._opens, _Open(spec, Future()))

    def submit_call(self, fn: Callable[[], object]) -> Future:
        """Run bookkeeping (close, stats) between steps."""
        return self._put(self._calls, (fn, Future()))

    # ---- the same, awaited (an event loop: a Ray replica, the in-process backend) --------------

    async def open_session(self, spec: SessionSpec) -> SessionOpened:
        """Open or re-open a session; returns its committed length and asked-for features.
        Cancelling abandons the open."""
        return await _wait("OpenSession", self.submit_open(spec))

    async def verify(self, block: DraftBlock) -> VerifyResult:
        """Verify one round in the next step (queued as `submit_round` queues it)."""
        return await _wait("Verify", self._put(self._rounds, _Round(block, Future(), time.perf_counter())))

    async def decode(self, block: DraftBlock, max_tokens: int, eos: frozenset[int]) -> AsyncIterator[int]:
        """Cloud-only decoding of up to `max_tokens` tokens from the empty block `block`, each the next
        round's bonus token, queued by the model thread itself (cloud/core/decoding.py)."""
        stream = DecodeStream(block, max_tokens, eos, asyncio.get_running_loop())
        self._put(self._rounds, _Round(block, Future(), time.perf_counter(), stream))
        async for token in stream.tokens():
            yield token

    async def close_session(self, session_id: str) -> bool:
        """Free a session; True if it existed."""
        return await _wait("CloseSession", self.submit_call(lambda: self._close(session_id)))

    async def stats(self) -> VerifierStats:
        """Sessions, cached tokens, evictions, held ids, KV cache size."""
        return await _wait("stats", self.submit_call(self.verifier.stats))

    async def aclose(self) -> None:
        """`stop`, without blocking the event loop."""
        await asyncio.get_running_loop().run_in_executor(None, self.stop)

    def stop(self) -> None:
        """Stop after the current step; queued work fails with Unavailable."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=30)
        gone = Unavailable("the verifier is shutting down")
        for item in [*self._rounds, *self._opens]:
            _resolve(item.future, gone)
            if getattr(item, "stream", None) is not None:
                item.stream.answered(item.block, gone)
        for _, future in self._calls:
            _resolve(future, gone)

    def _put(self, queue: deque, item):
        with self._cv:
            if self._stopped:
                raise Unavailable("the verifier is shutting down")
            queue.append(item)
            self._cv.notify()
        return item[1] if isinstance(item, tuple) else item.future

    # ---- the model thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            # 1. Wait for work, and briefly for the company of recently active sessions.
            free_since = time.perf_counter()
            with self._cv:
                while not (self._stopped or self._rounds or self._opens or self._calls):
                    self._cv.wait()
                if self._stopped:
                    return
                self._wait_for_company(free_since)
                step = self.schedule()
            # 2. Bookkeeping first: a close or a stats call never waits behind a long queue.
            for fn, future in step.calls:
                _resolve(future, _call(fn))
            if not step.rounds and not step.work.openings:
                if step.opens:
                    self._settle_opens(step.opens)  # opens refused at admission leave the queue
                continue
            # 3. One step: exactly the pass the schedule made.
            work = step.work
            started = time.perf_counter()
            try:
                results = self.verifier.step(work)
                if work.prefill_tokens:
                    self.cost.observe(time.perf_counter() - started, work.round_tokens + work.prefill_tokens)
                self._fed_last_step = work.prefill_tokens > 0
            except Exception as exc:  # a bug the verifier did not contain: fail this step, keep serving
                error = incident(log, exc, "a verification step")
                results = [error] * len(step.rounds)
                for session in work.openings:
                    session.fail(error, self.verifier.engine.release)
            # 4. Answer, timing each round here, where it arrived and is answered (the one place
            #    `verify_ms` and `queue_ms` are set): the wait before this step is its queueing.
            done = time.perf_counter()
            for item, result in zip(step.rounds, results):
                if isinstance(result, VerifyResult):
                    result = replace(result, verify_ms=(done - item.arrived) * 1e3,
                                     queue_ms=max(0.0, started - item.arrived) * 1e3)
                if item.stream is not None:
                    self._continue(item.stream, item.stream.answered(item.block, result), done)
                _resolve(item.future, result)
            if step.opens:
                self._settle_opens(step.opens)

    def _continue(self, stream: DecodeStream, follow: DraftBlock | None, now: float) -> None:
        """Queue a decode stream's next round (model thread), or end the stream if the scheduler stops."""
        if follow is None:
            return
        try:
            self._put(self._rounds, _Round(follow, Future(), now, stream))
        except Unavailable as exc:
            stream.answered(follow, exc)

    def _close(self, session_id: str) -> bool:
        """Close a session (model thread): it is no longer company to wait for, nor a reason to cut
        another session's prefill into small chunks."""
        with self._cv:
            self._recent.pop(session_id, None)
        return self.verifier.close_session(session_id)

    def schedule(self) -> Step:
        """Turn the queues into one step (cv held): every bookkeeping call; the opens, admitted
        (validated, room checked) on first sight; and the pass (cloud/core/passes.py `plan_pass`): up to
        max_batch queued rounds, one per session, as many as the engine's limits let one pass carry,
        and the prompt tokens the pass may carry beside them (`prefill_tokens`). Rounds left out stay
        queued; those the engine's limits held back go first in the next step."""
        calls, opens = list(self._calls), list(self._opens)
        self._calls.clear()
        live = [r for r in self._rounds if not r.future.cancelled()]
        feeding = self._admit_opens(opens) if opens else []

        def prompt(round_tokens: int) -> int:  # asked only when there is a prompt to feed
            return prefill_tokens(self.prefill_budget_ms, self.cost.ms_per_token, round_tokens,
                                  self.verifier.limits.prefill_chunk, self._others_active(feeding),
                                  self._fed_last_step)

        plan = plan_pass([r.block for r in live], feeding, prompt, self.verifier.engine.capabilities,
                         self.max_batch)
        self._rounds.clear()
        self._rounds.extend(live[i] for i in plan.split + plan.waiting)
        self._split = bool(plan.split)
        rounds = [live[i] for i in plan.taken]
        for r in rounds:
            self._recent[r.block.session_id] = r.arrived
        return Step(calls, rounds, opens, plan.work)

    def _wait_for_company(self, free_since: float) -> None:
        """Hold queued rounds while recently active sessions have none queued (cv held): at most
        max_wait after the model became free or the oldest round arrived, whichever is later. The
        sessions answered by the step that just ended need that moment to send their next round."""
        if not self._rounds or self.max_wait_s == 0 or self._split:
            return  # (the rounds the last pass could not carry were ready for it: they go at once)
        deadline = max(free_since, self._rounds[0].arrived) + self.max_wait_s
        while not self._stopped:
            now = time.perf_counter()
            for sid in [s for s, t in self._recent.items() if now - t > ACTIVE_WINDOW_S]:
                del self._recent[sid]
            queued = {r.block.session_id for r in self._rounds}
            if len(queued) >= min(self.max_batch, len(self._recent | dict.fromkeys(queued))) or now >= deadline:
                return
            self._cv.wait(deadline - now)

    def _others_active(self, feeding: list[Session]) -> bool:
        """True if a session that is not being opened sent a round within ACTIVE_WINDOW_S."""
        now = time.perf_counter()
        opening = {s.spec.session_id for s in feeding}
        return any(now - t <= ACTIVE_WINDOW_S and sid not in opening for sid, t in self._recent.items())

    def _admit_opens(self, opens: list[_Open]) -> list[Session]:
        """The sessions to prefill this step, admitting new opens (validation, room)."""
        feeding = []
        for item in opens:
            if item.future.done():  # cancelled: _settle_opens frees it
                continue
            if item.session is None:
                try:
                    item.session = self.verifier.begin_open(item.spec)
                except HybridSpecError as exc:
                    _resolve(item.future, exc)
                    continue
                except Exception as exc:
                    _resolve(item.future, incident(log, exc, "an open"))
                    continue
            if item.session.phase is Phase.PREFILLING:
                feeding.append(item.session)
        return feeding

    def _settle_opens(self, opens: list[_Open]) -> None:
        """Answer the opens that finished or failed and drop them (and the cancelled) from the queue."""
        finished = set()
        for item in opens:
            session = item.session
            if item.future.cancelled() and session is not None:
                self.verifier.abandon(session)
            elif session is not None and session.phase is Phase.LIVE:
                _resolve(item.future, session.opened())
            elif session is not None and session.phase is Phase.FAILED:
                _resolve(item.future, session.error)
            if item.future.done():
                finished.add(id(item))
        with self._cv:
            kept = [i for i in self._opens if id(i) not in finished]
            self._opens.clear()
            self._opens.extend(kept)


def _call(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except HybridSpecError as exc:
        return exc
    except Exception as exc:
        return incident(log, exc, "a verifier call")


def _resolve(future: Future, value: object) -> None:
    """Set a result unless the caller cancelled or it is answered already."""
    if not future.done() and future.set_running_or_notify_cancel():
        future.set_result(value)


async def _wait(what: str, future: Future):
    """Await a scheduler future from an event loop; cancelling the await cancels the work. Any
    exception that is not a domain error becomes an Internal error with a logged incident id, so a
    caller only ever sees a HybridSpecError."""
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
