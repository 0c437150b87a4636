"""One replica's serving core: the target on its engine, the sessions verified against it, and the step
that runs every forward pass. No gRPC and no Ray: requests and replies are the plain dataclasses of
common/protocol/wire.py, errors the domain errors of common/protocol/errors.py.

A step (`Verifier.step`) reads top-down:
  1. take what is queued: bookkeeping calls (run at once), opens (a new one is admitted here:
     validated and given a session slot, since a pass is planned over sessions), rounds (verify
     blocks and cloud-only decode steps alike);
  2. plan the pass: `plan_pass` (cloud/core/passes.py), a pure function of the queues, the engine's
     capabilities and who asks (`_shares`: each session's identity and weight, each identity's share
     of the passes so far, who holds a stream); what it leaves goes first in the next step;
  3. admit each round: its session, the block's validation, a replay answered from memory;
  4. reserve KV for every feed, evicting what may be evicted (from the identity most over its share of
     the cache first); a new session first starts from a cached prefix of its prompt;
  5. one `engine.forward` over every feed, timed;
  6. the pass's time learnt and charged to the feeds' identities; each round's rule (cloud/core/rules.py)
     and commit; opened sessions whose prompt is cached go live;
  7. answer: time each round, resolve its future, queue a decode stream's next round, settle opens.
A failure in 3–6 is the item's own (its error is its answer; a session touched by a failed pass is
cut back to its committed tokens), and the step goes on for the others.

Threads. Any thread may queue work: `submit_round`, `submit_open`, `submit_call`, and the blocking and
awaited calls built on them. One condition, `_cv`, guards the queues and who steps (`_driver`); it is
held only to queue, to take and to hand work back. Everything else (the engine, the sessions, the
prefix cache, telemetry, the batching state) belongs to the one thread that steps: the model thread
while the verifier is started (`start`: a replica serving), else a blocking caller, which runs the
steps itself until its answer is in (tests, benchmarks, a co-located baseline); never two at once.
Answers reach an event loop through its `_Mail`: a step queues its answers (awaited rounds' results, decode
streams' tokens) and hands each loop all of its own in one call at the step's end, so a step that
answers 64 rounds wakes their loop once, not 64 times, and is not interrupted by that loop meanwhile.
An awaited open reports its progress from its own event loop (`aopen_progress`), reading the length
of its session's cache as the model thread grows it: an int, at worst one chunk old.

Two ways in. Blocking: `open_session`, `verify`, `verify_batch`, `close_session`, `stats`. Awaited:
`aopen_session`, `averify`, `adecode`, `aclose_session`, `astats` (an `a` marks the awaited twin, as
in the standard library's `aclose`), which with `start`, `stop` and the rest make a Verifier the
pool's `Replica` in the front door's process (cloud/pool/pool.py) and what a replica's own endpoint
serves (cloud/api/server.py). Awaited calls need the model thread: an event loop never steps.

Batching, on the model thread only. A lone round runs at once. Only while other sessions that sent
rounds recently have none queued does a round wait for their company, and then at most `max_wait_ms`
from the moment the model is free: under load the batch grows while the previous step runs, the
sessions that step answered get a moment to rejoin, and a single edge never pays a batching delay.
Prompts are paced by time (cloud/core/passes.py `prefill_tokens`). A blocking caller stepping on its
own has nobody to wait for: its steps take what is queued at once and feed prompts in whole chunks,
so its answers never depend on timing.

Integrity rules, enforced here for every caller:
- Everything a request carries is validated before any state changes.
- A round commits fully or leaves its session exactly as it was: if anything fails after the forward
  pass extended a session's cache, the cache is cut back to the committed tokens. So a cache never
  holds more than the committed tokens plus the block being scored, and one session's failure is
  never another's.
- A replayed round is answered from memory only when it is the very block that was answered.
- On a server with credentials, a session's rounds are taken only from the identity that opened it.
- An opening session becomes visible only once its whole prompt is cached.
- Every item queued is answered: the queues are made once and changed only in place under `_cv` (a
  submitter holds the queue object before it takes the lock, so a swapped queue would lose its item).

Features (the target's final hidden states, for an edge's EAGLE drafter) go only to sessions that
asked (`SessionSpec.features`): the open's reply carries those of every committed token but the last,
each round's those of [last committed token, accepted drafts]; a replay returns the same ones.

Cloud-only decoding. A cloud-only token is the bonus token of an empty round. A `DecodeStream` lives
on the model thread: when a step answers one of its rounds, step 7 queues the next at once and the
token goes to the consumer's event loop without anything waiting for it (sent one round at a time
from an event loop, every token would wait for its answer to cross to the loop and the next round to
cross back, while the engine idled). Its rounds are ordinary rounds: they batch with other sessions'
and obey every rule a round does; the stream ends after its budget, at an end-of-sequence token, on
an error, or when its consumer goes away.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ...common.maths.features import encode_features
from ...common.models.loading import tokenizer_fingerprint
from ...common.protocol.errors import (FailedPrecondition, HybridSpecError, InvalidArgument, ResourceExhausted,
                                       Unavailable, incident)
from ...common.protocol.tree import feed_parents
from ...common.protocol.wire import (DraftBlock, FeatureBlock, FeatureFormat, ModelInfo, OpenProgress, SessionOpened,
                                     PROGRESS_EVERY_S, SessionSpec, VerifyResult, opened_from)
from ..engine.base import Engine, Feed, KVSequence, Parking, Scores, Target
from ..engine.torch_engine import engine_for
from .costs import BATCH_SESSIONS, CurveMeasurement
from .holding import QUORUM, Returns, Waiting, policy
from .limits import (DEFAULT_FAIR_SHARE, DEFAULT_HOLD, DEFAULT_MAX_BATCH, DEFAULT_MAX_WAIT_MS,
                     DEFAULT_PREFILL_BUDGET_MS, Hold, VerifierLimits)
from .passes import Pass, PassTime, Shares, StepCost, Usage, plan_pass, prefill_tokens, tree_nodes
from .prefixes import PrefixCache, PrefixStats, Source
from .rules import Decision, decide_pass
from .session import FULL_RETRY_S, Phase, Session, SessionStore
from .telemetry import Part, ReplicaTelemetry, StepClock, Tally, Telemetry

log = logging.getLogger(__name__)

ACTIVE_WINDOW_S = 0.5  # a session that sent a round this recently is expected to send another
HELD_BACK_WAIT_S = 0.01  # the model thread's nap when every queued round waits for a stream
PROGRESS_S = PROGRESS_EVERY_S / 2  # an awaited open reports how far it got this often: twice what the wire promises
_END = object()  # a decode stream's last item


@dataclass(frozen=True)
class VerifierStats:
    """Counters a replica reports to the front door's metrics."""

    sessions: int
    cached_tokens: int
    evictions: int
    session_ids: tuple[str, ...] = ()  # the sessions held right now, for the front door's routing table
    kv_capacity_tokens: int = 0  # what the KV pool holds in all
    telemetry: ReplicaTelemetry | None = None  # time to first token, inter-token latency, step sizes, KV fill
    prefixes: PrefixStats = PrefixStats()  # prefix reuse since the start, closed sessions' caches kept now
    parked_tokens: int = 0  # tokens of idle sessions parked in host memory (an engine that parks)


class Answer(Protocol):
    """A round's answer slot, as the step settles it through a mail (`_settle`): an awaited round's
    asyncio future, or `post_rounds`'s caller's own."""

    def cancelled(self) -> bool:
        """The caller left: the round is not taken (or not answered, if it was)."""

    def done(self) -> bool:
        """Answered or cancelled."""

    def set_result(self, result: VerifyResult | HybridSpecError) -> None:
        """The answer (run by the mail's `send`)."""


class Mail(Protocol):
    """Where a step posts its answers (`post`) and hands them on at its end (`send`)."""

    closed: bool  # nothing sent would be run

    def post(self, fn: Callable[[object], None], arg: object) -> None:
        """Run fn(arg) at the next `send`."""

    def send(self) -> None:
        """Run what was posted (or have its loop run it)."""


class _Mail:
    """What the stepping thread hands one event loop: queued as a step answers (`post`) and run on the loop
    in one call when the step ends (`send`). Each call across threads is a write to the loop's wake-up pipe
    and lets the loop's thread take the interpreter in the middle of the step: once per step, not per round."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        self._items: list[tuple[Callable[[object], None], object]] = []
        self._due = False  # a delivery is scheduled and has not run yet
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        """The loop is gone or closed: nothing sent would run."""
        loop = self._loop()
        return loop is None or loop.is_closed()

    def post(self, fn: Callable[[object], None], arg: object) -> None:
        """Run fn(arg) on the loop at the next `send`."""
        with self._lock:
            self._items.append((fn, arg))

    def send(self) -> None:
        """Hand the loop what is posted, in one call (dropped if the loop is closed: nobody waits for it)."""
        with self._lock:
            if self._due or not self._items:
                return
            self._due = True
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the loop is gone")
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            with self._lock:
                self._items.clear()
                self._due = False

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, self._due = self._items, [], False
        for fn, arg in items:
            fn(arg)


_MAILS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mail] = weakref.WeakKeyDictionary()


def _mail() -> _Mail:
    """The running loop's mail (called on that loop)."""
    loop = asyncio.get_running_loop()
    mail = _MAILS.get(loop)
    return mail if mail is not None else _MAILS.setdefault(loop, _Mail(loop))


class DecodeStream:
    """One session's decode steps; `answered` runs on the model thread, `tokens` on the consumer's loop."""

    def __init__(self, first: DraftBlock, max_tokens: int, eos: frozenset[int], mail: _Mail) -> None:
        self.first = first  # an empty block at the session's current length
        self.mail = mail  # the consumer's loop's
        self._left = max_tokens
        self._eos = eos
        self._queue: asyncio.Queue = asyncio.Queue()
        self._gone = False  # the consumer stopped listening

    def answered(self, block: DraftBlock, result: VerifyResult | HybridSpecError) -> DraftBlock | None:
        """Hand a step's answer to `block` to the consumer; returns the next round to queue, or None
        when the stream is over (budget spent, end of sequence, an error, nobody listening)."""
        if not isinstance(result, VerifyResult):
            self._push(result)
            return None
        token = result.next_token
        self._left -= 1
        self._push(token)
        if self._left > 0 and token not in self._eos and not self._gone and not self.mail.closed:
            return replace(block, round=block.round + 1, committed_len=block.committed_len + 1)
        self._push(_END)
        return None

    async def tokens(self) -> AsyncIterator[int]:
        """The stream's tokens as they are decoded; raises the domain error that ended it, if any."""
        try:
            while True:
                item = await self._queue.get()
                if item is _END:
                    return
                if isinstance(item, HybridSpecError):
                    raise item
                yield item
        finally:
            self._gone = True

    def _push(self, item: object) -> None:
        self.mail.post(self._queue.put_nowait, item)


@dataclass(slots=True)
class _Round:
    block: DraftBlock
    future: Future | Answer  # an awaited round's is its loop's asyncio future, answered through `mail`
    arrived: float
    stream: DecodeStream | None = None  # a cloud-only stream's round: its answer queues the next one
    mail: Mail | None = None  # where an awaited round's answer (or its stream's token) goes

    def answer(self, result: VerifyResult | HybridSpecError) -> Mail | None:
        """Resolve the round: a blocking caller's future at once, an awaited one's through its loop's
        mail; returns the mail the step must send (an awaited round's or its decode stream's), if any."""
        if isinstance(self.future, Future):
            _resolve(self.future, result)
        else:
            self.mail.post(_settle, (self.future, result))
        return self.mail


@dataclass
class _Open:
    spec: SessionSpec
    future: Future
    session: Session | None = None  # set once a step has admitted it


Round = tuple[int, DraftBlock, Session]  # (index among the pass's rounds, the block, its session)


class Verifier:
    """Owns one engine (the target and its KV cache), the sessions verified against it, and the step
    that serves them; in the front door's process it is also the pool's only replica."""

    alive = answering = True  # it never dies or stops on its own
    failures = 0
    paces = False  # whoever serves it charges its callers' rates
    verify_address = ""  # no endpoint of its own: its rounds come through the front door

    def __init__(self, target: Target, limits: VerifierLimits | None = None, engine: Engine | None = None, *,
                 max_batch: int = DEFAULT_MAX_BATCH, max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
                 prefill_budget_ms: float = DEFAULT_PREFILL_BUDGET_MS, hold: Hold = DEFAULT_HOLD,
                 fair_share: bool = DEFAULT_FAIR_SHARE, name: str = "in-process") -> None:
        """`engine` defaults to the torch engine over `target`'s model (a LoadedModel). The batching
        settings apply on the model thread (cloud/pool/specs.py `ReplicaSettings`; `hold`: which
        rounds a queued one waits for, cloud/core/holding.py); `fair_share` off: rounds go into passes
        by arrival whoever sent them (cloud/core/passes.py); `name` is the replica's in a pool."""
        if max_batch < 1 or max_wait_ms < 0 or not prefill_budget_ms > 0:
            raise ValueError(f"max_batch must be >= 1, max_wait_ms >= 0 and prefill_budget_ms > 0, got {max_batch}, "
                             f"{max_wait_ms}, {prefill_budget_ms}")
        self.name = name
        self.target = target
        self.limits = limits if limits is not None else VerifierLimits()
        self.engine: Engine = engine if engine is not None else engine_for(
            target.model, self.limits.kv_cache_tokens, self.limits.max_context)
        caps = self.engine.capabilities
        if caps.max_sequence_tokens and caps.max_sequence_tokens < self.limits.max_context:
            # An engine with a fixed share of its cache per session (llama.cpp's per-session streams):
            # a session is refused past its share here, before eviction could be tried on its behalf.
            self.limits = replace(self.limits, max_context=caps.max_sequence_tokens)
        self.info = ModelInfo(
            model_name=target.name, vocab_size=target.vocab_size,
            tokenizer_fingerprint=tokenizer_fingerprint(target.tokenizer),
            model_fingerprint=target.fingerprint, max_context=self.limits.max_context,
            max_draft=self.limits.max_draft, max_sessions=self.limits.max_sessions,
            idle_timeout_s=self.limits.idle_timeout_s, eos_token_ids=target.eos_token_ids,
            device=caps.device, dtype=caps.dtype, feature_dim=caps.feature_dim,
            max_tree_nodes=tree_nodes(self.limits.max_tree_nodes, caps))
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1e3
        self.hold = policy(hold, self.max_wait_s)
        self.prefill_budget_ms = prefill_budget_ms
        self.fair_share = fair_share
        # The stepping thread's state.
        self.prefixes = PrefixCache(self.limits.prefix_scope, self.limits.prefix_cache_tokens, self.engine.release)
        self._sessions = SessionStore(self.limits.max_sessions, self.limits.idle_timeout_s, self.engine.release,
                                      self._retire)
        self.telemetry = Telemetry()
        self.clock = StepClock(enabled=False)  # a benchmark swaps in an enabled one (bench/hop_overhead.py host)
        self.cost = StepCost()  # of the steps that fed a prompt
        self.pass_time = PassTime()  # every pass's time, per feed (refitted from the measured curve: publish_pass_costs)
        self._usage = Usage()  # each active tenant's share of the passes so far
        self._parking = isinstance(self.engine, Parking)  # an engine that parks sessions beyond its streams
        if self._parking:
            self.engine.park_rank = self._park_rank
        self._stream_excess: dict[str, float] | None = None  # per tenant, streams held beyond its share (per step)
        self._kv_tenant: dict[int, str] = {}  # id of a resident cache -> its tenant, with _stream_excess
        self._held_back = False  # the last step ran nothing: every queued round waits for a stream
        self._fed_last_step = False
        self._split = False  # the last step left rounds for the engine's limits
        self._recent: dict[str, float] = {}  # session -> when its last round arrived
        self._cohort: dict[str, int] = {}  # session -> the pass that carried its last round
        self._returns = Returns(ACTIVE_WINDOW_S)  # how soon answered edges send their next round
        self._passes = 0  # passes run so far
        self._last_pass_s = 0.0  # the last pass's time, from admission to answers
        self._fresh: dict[str, float] = {}  # session -> when it went live (it keeps its stream for its first round)
        # Under `_cv`: the queues (made once, changed only in place) and who steps.
        self._cv = threading.Condition()
        self._rounds: deque[_Round] = deque()
        self._opens: deque[_Open] = deque()
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()
        self._thread: threading.Thread | None = None  # the model thread, while started
        self._driver: threading.Thread | None = None  # the thread stepping now: the model thread, or a blocking caller
        self._starts = 0  # starts not yet undone by a stop
        self._stopping = False

    # ---- queueing work (any thread) ------------------------------------------------------------

    def submit_round(self, block: DraftBlock) -> Future:
        """Verify one round in a coming step; resolves to a VerifyResult or a HybridSpecError."""
        return self._put(self._rounds, _Round(block, Future(), time.perf_counter()))

    def post_rounds(self, rounds: Sequence[tuple[DraftBlock, Answer]], mail: Mail) -> None:
        """Verify rounds in coming steps, each answer settled through `mail` as an awaited round's is: the
        step posts `answer.set_result(result)` to `mail` and calls `mail.send()` once at its end. A replica
        in a process of its own queues what each message from its front door carries that way, under one
        lock and with one wake-up, and sends a step's answers back in one message
        (cloud/pool/process_replica.py), with answer slots lighter than Futures."""
        now = time.perf_counter()
        with self._cv:
            if self._stopping:
                raise Unavailable("the verifier is shutting down")
            self._rounds.extend(_Round(block, answer, now, mail=mail) for block, answer in rounds)
            self._cv.notify()

    def submit_open(self, spec: SessionSpec) -> Future:
        """Open (or re-open, replacing) a session from its committed tokens; resolves to its
        SessionOpened (length, asked-for features) or a HybridSpecError. Cancelling the future before
        it resolves abandons the open and frees what it holds."""
        return self._put(self._opens, _Open(spec, Future()))

    def submit_call(self, fn: Callable[[], object]) -> Future:
        """Run bookkeeping (close, stats) on the stepping thread, first thing in the next step."""
        return self._put(self._calls, (fn, Future()))

    def wait(self, future: Future) -> object:
        """The answer to queued work, blocking. While no model thread runs, the caller steps itself
        until the answer is in, one caller at a time."""
        future.add_done_callback(self._wake)
        while True:
            with self._cv:
                while not future.done() and self._driver is not None:
                    self._cv.wait()
                if future.done():
                    return future.result()
                self._driver = threading.current_thread()
            try:
                while not future.done():
                    if not self.step():
                        raise RuntimeError("queued work was never answered")  # a bug in the step, not a state
            finally:
                with self._cv:
                    self._driver = None
                    self._cv.notify_all()

    # ---- blocking calls (direct callers: tests, benchmarks, a co-located baseline) -------------

    def open_session(self, spec: SessionSpec) -> SessionOpened:
        """Open (or re-open, replacing) a session; returns its length and the features it asked for."""
        return _raised(self.wait(self.submit_open(spec)))

    def verify(self, block: DraftBlock) -> VerifyResult:
        """Score one block in one forward pass over its session's cached context."""
        return _raised(self.wait(self.submit_round(block)))

    def verify_batch(self, blocks: Sequence[DraftBlock]) -> list[VerifyResult | HybridSpecError]:
        """Verify many sessions' rounds, as many in each pass as it may carry (a session's rounds in
        order, one per pass). Returns, per block and in order, its result or its error; one bad block
        never fails the others."""
        futures = [self.submit_round(block) for block in blocks]
        return [self.wait(future) for future in futures]  # type: ignore[misc]

    def close_session(self, session_id: str) -> bool:
        """End a session (its cache may be kept for new sessions to start from); True if it existed."""
        return _raised(self.wait(self.submit_call(lambda: self._close(session_id))))

    def stats(self) -> VerifierStats:
        """Sessions held, their cached tokens, evictions so far, and the KV cache's size."""
        return _raised(self.wait(self.submit_call(self._stats)))

    def measure_pass_costs(self, max_tokens: int) -> None:
        """Time passes of 1..max_tokens tokens (at most a whole round) and report them in `info` now, for
        the edges' block sizing (cloud/core/costs.py). It holds the engine meanwhile: a serving replica
        measures in the background instead (cloud/pool/replica.py)."""
        measurement = self.pass_cost_measurement(max_tokens)
        _raised(self.wait(self.submit_call(lambda: self.publish_pass_costs(*measurement.run()))))

    def pass_cost_measurement(self, max_tokens: int) -> CurveMeasurement:
        """What measuring this replica's curves takes (run on the stepping thread): passes of up to
        max_tokens tokens, at most a whole round (the root and its drafts, or a tree's nodes). On a GPU
        a pass of many sessions costs neither one session's pass nor their sum, so the edges also get
        the curves of the batch sizes this replica serves. A CPU pass is compute-bound (many sessions
        cost about their sum) and prefilling their contexts would take long."""
        largest = max(self.limits.max_draft, self.info.max_tree_nodes) + 1
        sessions = tuple(b for b in BATCH_SESSIONS if b <= self.max_batch)
        return CurveMeasurement(self.engine, self.info.vocab_size, min(max_tokens, largest),
                                sessions if self.engine.capabilities.device.startswith("cuda") else ())

    def idle(self) -> bool:
        """No session is open or being opened (read it on the stepping thread): a serving replica
        measures its pass-cost curve only then, so that no session waits for room it holds."""
        return not len(self._sessions) and not self._opens

    def publish_pass_costs(self, points: tuple[tuple[int, float], ...],
                           batches: tuple[tuple[int, int, float], ...] = ()) -> None:
        """Report measured curves in `info`, and so to every edge that asks from now on; the fair share's
        pass-time model starts from them (run on the stepping thread, which owns it)."""
        self.info = replace(self.info, pass_costs=points, batch_pass_costs=batches)
        self.pass_time = PassTime(points)

    # ---- the pool's Replica (awaited; cloud/pool/pool.py) --------------------------------------

    async def start(self) -> ModelInfo:
        """Start the model thread (the model came loaded); returns what it serves. Each start is undone
        by one `stop`: a verifier shared by several front doors steps until the last one stops."""
        with self._cv:
            self._starts += 1
            if self._thread is None:
                self._cv.wait_for(lambda: self._driver is None)  # a blocking caller's steps end first
                self._thread = self._driver = threading.Thread(target=self._serve, name="verifier-steps", daemon=True)
                self._thread.start()
        return self.info

    async def stop(self) -> None:
        """Undo one `start`; the last stops the model thread after its current step, and what is still
        queued fails with Unavailable. Blocking callers may step it themselves afterwards."""
        await asyncio.to_thread(self._halt)

    async def wait_alive(self) -> None:
        """Always alive."""

    def model_info(self) -> ModelInfo:
        """What it serves."""
        return self.info

    async def aopen_session(self, spec: SessionSpec,
                            progress: Callable[[OpenProgress], None] | None = None) -> SessionOpened:
        """`open_session`, awaited; cancelling abandons the open. `progress` is told how far it has got
        every PROGRESS_S (`aopen_progress`)."""
        return await opened_from(self.aopen_progress(spec), progress)

    async def aopen_progress(self, spec: SessionSpec) -> AsyncIterator[OpenProgress | SessionOpened]:
        """Open (or re-open) a session: how far it has got every PROGRESS_S, read from this event loop
        (so it shows that the replica's process is alive even while a pass takes long), then the answer.
        Raises the open's domain error; leaving early abandons the open."""
        item = _Open(spec, Future())
        answer = asyncio.ensure_future(_awaited("OpenSession", self._put(self._opens, item, awaited=True)))
        total = len(spec.committed_ids) - 1
        try:
            while True:
                done, _ = await asyncio.wait({answer}, timeout=PROGRESS_S)
                if done:
                    break
                session = item.session  # set by the model thread at admission; its length grows with each chunk
                yield OpenProgress(session.kv.length if session is not None else 0, total)
            yield answer.result()
        finally:
            if not answer.done():
                answer.cancel()  # the caller left: cancelling the awaited future abandons the open

    async def averify(self, block: DraftBlock) -> VerifyResult:
        """`verify`, awaited; cancelling the await cancels the round. Its answer comes with the others
        of its step (`_Mail`)."""
        future = asyncio.get_running_loop().create_future()
        self._put(self._rounds, _Round(block, future, time.perf_counter(), mail=_mail()), awaited=True)
        return _raised(await future)

    async def adecode(self, block: DraftBlock, max_tokens: int, eos: frozenset[int]) -> AsyncIterator[int]:
        """Cloud-only decoding of up to `max_tokens` tokens from the empty block `block`, each the next
        round's bonus token, queued by the model thread itself (`DecodeStream`)."""
        stream = DecodeStream(block, max_tokens, eos, _mail())
        self._put(self._rounds, _Round(block, Future(), time.perf_counter(), stream, stream.mail), awaited=True)
        async for token in stream.tokens():
            yield token

    async def aclose_session(self, session_id: str) -> bool:
        """`close_session`, awaited."""
        return await _awaited("CloseSession", self._put(self._calls, (lambda: self._close(session_id), Future()),
                                                        awaited=True))

    async def astats(self) -> VerifierStats:
        """`stats`, awaited."""
        return await _awaited("stats", self._put(self._calls, (self._stats, Future()), awaited=True))

    async def take_tally(self) -> Tally:
        """Nothing: no endpoint of its own."""
        return Tally()

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> bool:
        """One turn of the stepping thread (the module's docstring lists its seven steps): the model
        thread, or a blocking caller while none runs (`wait`), never anyone else. Returns False when
        nothing was queued."""
        clock = self.clock  # swapped by a benchmark between steps, never within one
        clock.start()
        # 1. Take what is queued. Bookkeeping runs first, so a close or a stats call never waits
        #    behind a long queue; a new open is admitted (validated, a session slot) so it can be planned.
        with self._cv:
            calls, opens = list(self._calls), list(self._opens)  # opens stay queued until settled (step 7)
            rounds = [r for r in self._rounds if not r.future.cancelled()]
            self._calls.clear()
            self._rounds.clear()
        if not (calls or opens or rounds):
            return False
        for fn, future in calls:
            _resolve(future, _call(fn))
        feeding = self._admit_opens(opens) if opens else []
        # 2. Plan the pass: one round per session, up to max_batch, as many as the engine may carry,
        #    each tenant its share, and the prompt tokens it may carry beside them. What it leaves goes
        #    first next time.
        shares = self._shares(rounds, feeding)
        plan = plan_pass([r.block for r in rounds], feeding, self._prompt_tokens(feeding), self.engine.capabilities,
                         self.max_batch, shares)
        with self._cv:
            self._rounds.extendleft(reversed([rounds[i] for i in plan.split + plan.waiting]))
        work, taken, self._split = plan.work, [rounds[i] for i in plan.taken], bool(plan.split)
        for item in taken:
            self._recent[item.block.session_id] = item.arrived
            self._cohort[item.block.session_id] = self._passes
            self._returns.arrived(item.block.session_id, item.arrived)
        # The hold forgets sessions gone quiet without a close (expired, evicted); where it never runs
        # (max_wait 0, a caller stepping itself), they are forgotten once they outnumber the live ones.
        if len(self._recent) > self.limits.max_sessions:
            self._forget_quiet(time.perf_counter())
        self._held_back = not taken and not work.openings and bool(rounds)
        if not taken and not work.openings:
            if opens:
                self._settle_opens(opens)  # opens refused at admission leave the queue
            return True
        clock.lap(Part.SCHEDULE)
        started = time.perf_counter()
        results: list[VerifyResult | HybridSpecError | None] = [None] * len(taken)
        try:
            # 3. Admit each round: identical replays are answered from memory, bad blocks get their error.
            rounds_in = self._admit(work.rounds, results)
            # 4. Room in the cache for every feed; a feed that cannot get it fails alone.
            feeds, rounds_in, chunks = self._reserve_feeds(rounds_in, work, results)
            clock.lap(Part.ADMIT)
            # 5. One pass: [newest committed token, x_1..x_γ] per round gives p_1..p_{γ+1}.
            sizes = [(len(feed.tokens), feed.kv.length) for feed in feeds]  # before the pass caches them
            scores, ms = self._forward(feeds, rounds_in, work.openings, results)
            clock.lap(Part.FORWARD)
            if scores is not None:
                # 6. The pass's cost is learnt and charged to its tenants; each round's rule; its session
                #    commits the accepted drafts and the new token; prompt chunks keep the features their
                #    session asked for.
                self._account(sizes, [session for *_, session in rounds_in] + [session for session, _ in chunks], ms,
                              shares)
                self._conclude_all(rounds_in, scores[:len(rounds_in)], results)
                for (session, position), chunk_scores in zip(chunks, scores[len(rounds_in):]):
                    self._keep_prefill_features(session, chunk_scores, position)
            # Sessions whose prompt is now cached go live. Only now: a re-open replaces (and frees)
            # the session of its id, whose cache a round of this very pass may have read.
            for session in work.openings:
                if session.phase is Phase.PREFILLING and session.remaining == 0:
                    self._sessions.go_live(session)
                    self._fresh[session.spec.session_id] = time.perf_counter()  # its first round comes next
            if work.prefill_tokens:
                self.cost.observe(time.perf_counter() - started, work.round_tokens + work.prefill_tokens)
            self._fed_last_step = work.prefill_tokens > 0
            clock.lap(Part.RULES)
        except Exception as exc:  # a bug the step did not contain: fail this step's items, keep serving
            error = incident(log, exc, "a verification step")
            results = [error] * len(taken)
            for session in work.openings:
                session.fail(error, self.engine.release)
        # 7. Answer, timing each round here, where it is answered (the one place `verify_ms` and
        #    `queue_ms` are set): the wait before this step is its queueing.
        done = time.perf_counter()
        self._passes, self._last_pass_s = self._passes + 1, done - started
        mails = set()
        for item, result in zip(taken, results):
            if isinstance(result, VerifyResult):
                result = result.timed((done - item.arrived) * 1e3, max(0.0, started - item.arrived) * 1e3)
            if item.stream is not None:  # the server queues its next round itself: no return to measure
                self._continue(item.stream, item.stream.answered(item.block, result), done)
            else:
                self._returns.answered(item.block.session_id, done)
            mails.add(item.answer(result))
        _send(mails)
        if opens:
            self._settle_opens(opens)
        clock.lap(Part.ANSWER)
        clock.done(len(taken))
        return True

    # ---- 1. taking work ------------------------------------------------------------------------

    def _admit_opens(self, opens: list[_Open]) -> list[Session]:
        """The sessions being opened, oldest first, admitting new opens: the spec checked against what
        is served, a session slot; a refused open is answered with its error."""
        feeding = []
        for item in opens:
            if item.future.done():  # cancelled: _settle_opens frees it
                continue
            if item.session is None:
                try:
                    item.session = self._begin_open(item.spec)
                except HybridSpecError as exc:
                    _resolve(item.future, exc)
                    continue
                except Exception as exc:
                    _resolve(item.future, incident(log, exc, "an open"))
                    continue
            if item.session.phase is Phase.PREFILLING:
                feeding.append(item.session)
        return feeding

    def _begin_open(self, spec: SessionSpec) -> Session:
        spec.check_against(self.info)
        if not isinstance(spec.features, FeatureFormat):
            raise InvalidArgument(f"features {spec.features!r} is not a FeatureFormat")
        if spec.features is not FeatureFormat.NONE and not self.engine.capabilities.feature_dim:
            raise InvalidArgument(f"the {self.engine.capabilities.name} engine cannot return features")
        self._sessions.reserve(spec.session_id)
        return Session(spec, self.engine.new_sequence())

    # ---- 2. what the planner is told -----------------------------------------------------------

    def _prompt_tokens(self, feeding: list[Session]) -> Callable[[int], int]:
        """How many prompt tokens a pass may carry beside its rounds' tokens (asked by `plan_pass` only
        when there is a prompt to feed): the prefill policy on the model thread, whole chunks for a
        blocking caller stepping on its own."""
        chunk = self.limits.prefill_chunk
        if threading.current_thread() is not self._thread:
            return lambda round_tokens: chunk
        return lambda round_tokens: prefill_tokens(self.prefill_budget_ms, self.cost.ms_per_token, round_tokens, chunk,
                                                   self._others_active(feeding), self._fed_last_step)

    def _others_active(self, feeding: list[Session]) -> bool:
        """True if a session that is not being opened sent a round within ACTIVE_WINDOW_S."""
        now = time.perf_counter()
        opening = {s.spec.session_id for s in feeding}
        return any(now - t <= ACTIVE_WINDOW_S and sid not in opening for sid, t in self._recent.items())

    def _shares(self, rounds: list[_Round], feeding: list[Session]) -> Shares | None:
        """Who asks, for the planner's fair share and stream rotation (cloud/core/passes.py): the tenants
        of the sessions with rounds queued, being opened or recently active, their weights and usage,
        what each round would add to the pass, and on an engine that parks, who holds a stream and since
        when. None for a blocking caller stepping on its own: its passes never depend on timing."""
        self._stream_excess = None  # the parking ranks of this step are worked out when first needed
        if threading.current_thread() is not self._thread:
            return None
        now, clock = time.perf_counter(), time.monotonic()
        self._fresh = {sid: t for sid, t in self._fresh.items() if now - t <= ACTIVE_WINDOW_S}
        recent = {sid for sid, t in self._recent.items() if now - t <= ACTIVE_WINDOW_S} | set(self._fresh)
        sessions = {sid: s for sid in recent | {r.block.session_id for r in rounds}
                    if (s := self._sessions.find(sid)) is not None}
        sessions.update((s.spec.session_id, s) for s in feeding)
        tenant = {sid: self._tenant(s) for sid, s in sessions.items()}
        active = frozenset(tenant.values())
        resident = None
        if self._parking:
            since = {sid: self.engine.resident_since(s.kv) for sid, s in sessions.items()}
            resident = {sid: clock - t for sid, t in since.items() if t is not None}
        return Shares(tenant, {tenant[sid]: s.spec.weight for sid, s in sessions.items()}, self._usage.settle(active),
                      active, self.prefill_budget_ms,
                      lambda block: self.pass_time.feed_ms(len(block.draft_ids) + 1, block.committed_len),
                      [now - r.arrived for r in rounds], resident, self.engine.capabilities.max_sequences_per_pass,
                      frozenset(recent | {s.spec.session_id for s in feeding}))

    def _tenant(self, session: Session) -> str:
        """Whose share a session draws on: its identity's, or everyone's one share with fair share off."""
        return session.spec.tenant if self.fair_share else ""

    # ---- 3. admitting rounds -------------------------------------------------------------------

    def _admit(self, blocks: Sequence[DraftBlock], results: list) -> list[Round]:
        """The rounds to score; replays get their stored answer, bad blocks their error."""
        admitted = []
        for i, block in enumerate(blocks):
            try:
                session = self._sessions.get(block.session_id)
                block.validate(self.info.vocab_size, self.limits.max_draft,
                               needs_probs=session.spec.mode.uses_draft_probs,
                               max_tree_nodes=self.info.max_tree_nodes, trees=session.spec.mode.verifies_trees)
                if session.admit(block, self.limits.max_context):
                    results[i] = session.last_result
                else:
                    admitted.append((i, block, session))
            except HybridSpecError as exc:
                results[i] = exc
        return admitted

    # ---- 4. room in the KV cache ---------------------------------------------------------------

    def _reserve_feeds(self, admitted: list[Round], work: Pass,
                       results: list) -> tuple[list[Feed], list[Round], list[tuple[Session, int]]]:
        """The pass's feeds: every admitted round that gets room, then prompt chunks of up to
        `work.streams` openings and `work.prefill_tokens` tokens (with, per chunk, its session and the
        position of its first token)."""
        feeds, rounds, chunks = [], [], []
        for i, block, session in admitted:
            tokens = session.round_tokens(block)
            try:
                self._room_for(session, len(tokens), work)
            except HybridSpecError as exc:
                results[i] = self._no_room(f"this round's {len(tokens)} tokens", work, exc)
                continue
            feeds.append(Feed(session.kv, tokens, scored=True, features=_wants_features(session.spec),
                              parents=feed_parents(block.parents) if block.is_tree else None))
            rounds.append((i, block, session))
        budget, streams = work.prefill_tokens, work.streams
        for session in work.openings:
            if budget == 0 or streams == 0 or session.phase is not Phase.PREFILLING:
                continue
            if not session.looked_for_prefix:
                self._start_from_prefix(session, work)
            if session.remaining == 0:  # a one-token prompt, or one cached whole by another session
                streams -= session.kv.length > 0
                continue
            start, chunk = session.kv.length, session.next_chunk(budget)
            try:
                self._room_for(session, len(chunk), work)
            except HybridSpecError as exc:
                session.fail(self._no_room(f"a {len(session.committed):,}-token prompt", work, exc),
                             self.engine.release)
                continue
            feeds.append(Feed(session.kv, chunk, scored=False, features=_wants_features(session.spec)))
            chunks.append((session, start))
            budget -= len(chunk)
            streams -= 1
        return feeds, rounds, chunks

    def _no_room(self, what: str, work: Pass, error: HybridSpecError) -> HybridSpecError:
        """The refusal of a feed the cache could not make room for (`error`, the engine's): what was
        asked, the replica's state, and when to retry (RetryInfo)."""
        if not isinstance(error, ResourceExhausted):
            return error
        held = len(self._sessions)
        busy = sum(sid in work.keep for sid in self._sessions.ids())
        used = round(self.engine.fill() * self.engine.capacity_tokens) + getattr(self.engine, "parked_tokens", 0)
        idle = held - busy
        why = ("none is idle, to be parked or evicted" if idle == 0 else
               "the idle one belongs to an identity within its share of the cache" if idle == 1 else
               f"the {idle} idle ones belong to identities within their share of the cache")
        return ResourceExhausted(
            f"this replica has no room for {what} now: it holds {held} session{'s' * (held != 1)} in {used:,} of its "
            f"{self.limits.kv_cache_tokens:,} KV tokens, {busy} of them busy, and {why}; retry in about "
            f"{FULL_RETRY_S:g} s", FULL_RETRY_S)

    def _start_from_prefix(self, session: Session, work: Pass) -> None:
        """Start a new session's cache from the longest prefix of its prompt that a session of its
        scope cached (cloud/core/prefixes.py), if there is one and room for it; else nothing changes."""
        session.looked_for_prefix = True
        if _wants_features(session.spec):
            return  # its open must return the prompt's features, which only a prefill computes
        sources = (Source(s.committed, s.kv, s.spec.owner) for s in self._sessions.live())
        found = self.prefixes.find(session.committed[:-1], session.spec.owner, sources)
        if found is None:
            return
        source, length = found
        try:
            self._make_room(session, length, work, spare=source)
            self.engine.copy_prefix(source, session.kv, length)
        except HybridSpecError:
            return  # no room now: the prompt is prefilled as usual, or refused as it would have been
        self.prefixes.hit(length)

    def _room_for(self, session: Session, tokens: int, work: Pass) -> None:
        """Room for `tokens` more tokens of `session`'s cache, made if the cache is full (`_make_room`)."""
        self._make_room(session, tokens, work)
        self.engine.reserve(session.kv, tokens)

    def _make_room(self, session: Session, tokens: int, work: Pass, spare: KVSequence | None = None) -> None:
        """Until `tokens` more tokens of `session`'s cache fit: drop closed sessions' kept caches, then
        evict sessions, from the tenant most over its share of the cache first (SessionStore.make_room):
        never one in the pass, nor the cache `spare`; one with work queued only for a tenant within its
        share, from a tenant over its own."""
        kv = session.kv
        if self.engine.fits(kv, tokens):  # the usual case, asked for every feed of every pass
            return
        fits = lambda: self.engine.fits(kv, tokens)  # noqa: E731
        while not fits() and self.prefixes.drop_oldest(spare):
            pass
        if not fits():
            self._sessions.make_room(fits, work.keep, spare, session, self.limits.kv_cache_tokens, work.running)

    # ---- 5. the forward pass -------------------------------------------------------------------

    def _forward(self, feeds: list[Feed], rounds: list[Round], openings: Sequence[Session],
                 results: list) -> tuple[list[Scores] | None, float]:
        """The engine's pass and its milliseconds. On failure every fed session is left as it was and the
        pass's rounds and opens get the incident."""
        if not feeds:
            return None, 0.0
        try:
            started = time.perf_counter()
            scores = self.engine.forward(feeds)
            return scores, (time.perf_counter() - started) * 1e3
        except Exception as exc:  # a bug or a failed device: no session changes
            error = incident(log, exc, "a verification forward pass")
            for i, _, session in rounds:
                session.roll_back(self.engine.truncate)
                results[i] = error
            for session in openings:
                if session.phase is Phase.PREFILLING:
                    session.fail(error, self.engine.release)
            return None, 0.0

    def _account(self, sizes: list[tuple[int, int]], owners: list[Session], ms: float, shares: Shares | None) -> None:
        """What a pass of `ms` over feeds of `sizes` ((tokens, cached before) each) teaches: the pass-time
        model learns from it, and each feed's tenant (`owners`, per feed) is charged its part; with
        `shares` (the step's, None for a blocking caller, whose passes never use them) of one tenant, that
        tenant the whole pass."""
        self.telemetry.iteration_tokens.observe(sum(tokens for tokens, _ in sizes))
        if shares is not None and len(shares.active) == 1:  # every feed is that tenant's
            (tenant,) = shares.active
            self._usage.charge(tenant, ms, shares.weight_of(tenant))
        elif shares is not None:
            used: dict[tuple[str, float], float] = {}  # one charge per tenant (and weight), not per feed
            for session, part in zip(owners, self.pass_time.split(sizes, ms)):
                key = (self._tenant(session), session.spec.weight)
                used[key] = used.get(key, 0.0) + part
            for (tenant, weight), part in used.items():
                self._usage.charge(tenant, part, weight)
        self.pass_time.observe(sizes, ms)

    # ---- 6. rules and commit -------------------------------------------------------------------

    def _conclude_all(self, rounds: list[Round], scores: list[Scores], results: list) -> None:
        """Every round's rule on its rows (`decide_pass`: what the rules read is taken from the logits for the
        whole pass at once, one argmax over the greedy rounds' rows, the sampling rounds' probabilities in
        one copy to the host; one wait for the device, not one per round), then each round's commit."""
        answered = time.monotonic()
        whole = scores[0].in_pass if scores else None
        rows = (whole, [s.rows for s in scores]) if whole is not None and all(s.in_pass is whole for s in scores) \
            else None
        decisions = decide_pass([session.spec for _, _, session in rounds], [block for _, block, _ in rounds],
                                [s.logits for s in scores], [session.committed for _, _, session in rounds], rows)
        for (i, block, session), round_scores, decision in zip(rounds, scores, decisions):
            results[i] = self._conclude(block, session, round_scores, decision, len(rounds), answered)

    def _conclude(self, block: DraftBlock, session: Session, scores: Scores, decision: Decision | Exception,
                  batch_size: int, answered: float) -> VerifyResult | HybridSpecError:
        """Keep the KV of the session's committed tokens and the round's accepted drafts (the new token is
        fed at the head of the next block) and commit the rule's `decision`. A failure (the rule's
        included) is this session's alone."""
        try:
            if isinstance(decision, Exception):
                raise decision
            nodes, token = decision
            # Fed rows that stay: the newest committed token (row 0) and the accepted nodes. Their
            # features are the session's next committed context, and only their keys stay cached.
            kept = [0, *(node + 1 for node in nodes)]
            features = _features(session.spec, scores.hidden, len(session.committed) - 1, kept) \
                if _wants_features(session.spec) else None
            if block.is_tree:
                self.engine.keep_rows(session.kv, len(session.committed) - 1, kept)
            else:
                self.engine.truncate(session.kv, len(session.committed) + len(nodes))
        except Exception as exc:
            session.roll_back(self.engine.truncate)
            return incident(log, exc, "a verification rule")
        self._observe_latency(session, len(nodes) + 1, answered)
        result = VerifyResult(block.round, len(nodes), token, len(session.committed) + len(nodes) + 1,
                              batch_size=batch_size, features=features,
                              accepted_path=tuple(nodes) if block.is_tree else ())
        session.commit(block, [block.draft_ids[node] for node in nodes], result)
        return result

    def _keep_prefill_features(self, session: Session, scores: Scores, position: int) -> None:
        try:
            features = _features(session.spec, scores.hidden, position)
        except Exception as exc:
            session.fail(incident(log, exc, "encoding features"), self.engine.release)
            return
        if features is not None:
            session.prefill_features.append(features)

    def _observe_latency(self, session: Session, tokens: int, now: float) -> None:
        """A new generation's first answer is its time to first token; every later answer spreads the
        time since the previous one over the tokens it commits. The first answer after a re-open is
        neither (its wait was the edge's recovery)."""
        if session.answered_at:
            self.telemetry.itl.observe((now - session.answered_at) / tokens, tokens)
        elif len(session.spec.committed_ids) == session.spec.prompt_end:
            self.telemetry.ttft.observe(now - session.opened_at)
        session.answered_at = now

    # ---- 7. answers ----------------------------------------------------------------------------

    def _continue(self, stream: DecodeStream, follow: DraftBlock | None, now: float) -> None:
        """Queue a decode stream's next round, or end the stream if the verifier is stopping."""
        if follow is None:
            return
        try:
            self._put(self._rounds, _Round(follow, Future(), now, stream, stream.mail))
        except Unavailable as exc:
            stream.answered(follow, exc)

    def _settle_opens(self, opens: list[_Open]) -> None:
        """Answer the opens that finished or failed and drop them (and the cancelled) from the queue."""
        finished = set()
        for item in opens:
            session = item.session
            if item.future.cancelled() and session is not None:
                if session.phase is Phase.PREFILLING:  # the opener went away: free what the open holds
                    session.fail(FailedPrecondition("the open was abandoned"), self.engine.release)
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

    # ---- bookkeeping (calls, on the stepping thread) -------------------------------------------

    def _close(self, session_id: str) -> bool:
        """Close a session: it is no longer company to wait for, nor a reason to cut another session's
        prefill into small chunks."""
        self._forget(session_id)
        return self._sessions.pop(session_id)

    def _stats(self) -> VerifierStats:
        self._sessions.expire_idle()
        return VerifierStats(len(self._sessions), self._sessions.cached_tokens, self._sessions.evictions,
                             self._sessions.ids(), self.engine.capacity_tokens,
                             self.telemetry.snapshot(self.engine.fill(), *self._compared()), self.prefixes.stats(),
                             getattr(self.engine, "parked_tokens", 0))

    def _park_rank(self, kv: KVSequence) -> float:
        """The engine's order for parking idle sessions (engine.base.Parking): the tenant holding the
        most streams beyond its share first (streams × weight / the weights of the tenants holding one)."""
        if self._stream_excess is None:
            owners = [s for s in self._sessions.live() if self.engine.resident_since(s.kv) is not None]
            held, weights = {}, {}
            for s in owners:
                tenant = self._tenant(s)
                held[tenant], weights[tenant] = held.get(tenant, 0) + 1, s.spec.weight
            streams, total = self.engine.capabilities.max_sequences_per_pass, sum(weights.values())
            self._stream_excess = {t: held[t] - streams * weights[t] / total for t in held}
            self._kv_tenant = {id(s.kv): self._tenant(s) for s in owners}
        return -self._stream_excess.get(self._kv_tenant.get(id(kv), ""), 0.0)

    def _retire(self, session: Session) -> None:
        """A closed session's cache: kept for new sessions to start from, or released."""
        self.prefixes.keep(session.committed, session.kv, session.spec.owner)

    # ---- the queues and the model thread -------------------------------------------------------

    def _put(self, queue: deque, item, awaited: bool = False) -> Future:
        """Queue `item` and wake the model thread. Unavailable while stopping, and for an awaited call
        without a model thread: an event loop never steps, so nothing would answer it."""
        with self._cv:
            if self._stopping:
                raise Unavailable("the verifier is shutting down")
            if awaited and self._thread is None:
                raise Unavailable("the verifier is not started")
            queue.append(item)
            self._cv.notify()
        return item[1] if isinstance(item, tuple) else item.future

    def _wake(self, _: Future) -> None:
        with self._cv:
            self._cv.notify_all()

    def _serve(self) -> None:
        """The model thread: wait for work, and briefly for the company of recently active sessions;
        step; until stopped."""
        while True:
            free_since = time.perf_counter()
            with self._cv:
                while not (self._stopping or self._rounds or self._opens or self._calls):
                    self._cv.wait()
                if self._stopping:
                    return
                if self._held_back:  # nothing could run: wait for new work, or for a stream to come free
                    self._held_back = False
                    self._cv.wait(HELD_BACK_WAIT_S)
                    continue
                clock = self.clock  # swapped by a benchmark between waits, never within one
                clock.start()
                self._wait_for_company(free_since)
                clock.lap(Part.HOLD)
            self.step()

    def _wait_for_company(self, free_since: float) -> None:
        """Hold queued rounds for the company of others' while the batching policy says so (cv held;
        cloud/core/holding.py), asked again at each arrival: its holding starts when the model became
        free or the oldest round arrived, whichever is later. The sessions answered by the step that
        just ended need that moment to send their next round."""
        if not self._rounds or self.max_wait_s == 0 or self._split:
            return  # (the rounds the last pass could not carry were ready for it: they go at once)
        since = max(free_since, self._rounds[0].arrived)
        fixed_s, return_s = self._compared()
        while not self._stopping:
            now = time.perf_counter()
            self._forget_quiet(now)
            queued = frozenset(r.block.session_id for r in self._rounds)
            until = self.hold.hold_until(Waiting(now, since, queued, queued.union(self._recent), self.max_batch,
                                                 self._last_pass_s, self._cohort, fixed_s, return_s))
            if until is None:
                return
            self._cv.wait(until - now)

    def _compared(self) -> tuple[float, float]:
        """What the auto hold compares (s): a pass's fixed part, and how soon QUORUM of answered edges came back."""
        return self.pass_time.coef[0] / 1e3, self._returns.within(QUORUM)

    def _forget_quiet(self, now: float) -> None:
        """Sessions that sent no round within ACTIVE_WINDOW_S are no longer company to hold for."""
        for sid in [s for s, t in self._recent.items() if now - t > ACTIVE_WINDOW_S]:
            self._forget(sid)

    def _forget(self, session_id: str) -> None:
        """Drop what batching keeps of a session (closed, or quiet)."""
        self._recent.pop(session_id, None)
        self._cohort.pop(session_id, None)
        self._returns.forget(session_id)

    def _halt(self) -> None:
        """`stop` on a thread of its own: the last stop ends the model thread, then fails what is queued."""
        with self._cv:
            self._starts = max(0, self._starts - 1)
            thread = self._thread
            if self._starts or thread is None:
                return
            self._stopping = True
            self._cv.notify_all()
        thread.join(timeout=30)
        with self._cv:
            rounds, opens, calls = list(self._rounds), list(self._opens), list(self._calls)
            self._rounds.clear()
            self._opens.clear()
            self._calls.clear()
        gone = Unavailable("the verifier is shutting down")
        for item in rounds:
            if item.stream is not None:
                item.stream.answered(item.block, gone)
        _send({item.answer(gone) for item in rounds})
        for item in opens:
            if item.session is not None and item.session.phase is Phase.PREFILLING:
                item.session.fail(gone, self.engine.release)
            _resolve(item.future, gone)
        for _, future in calls:
            _resolve(future, gone)
        with self._cv:
            self._thread = self._driver = None
            self._stopping = False
            self._cv.notify_all()


def _wants_features(spec: SessionSpec) -> bool:
    return spec.features is not FeatureFormat.NONE


def _features(spec: SessionSpec, hidden: torch.Tensor | None, position: int,
              rows: list[int] | None = None) -> FeatureBlock | None:
    """The features of a feed's `rows` (all if None) as the session's consecutive positions from
    `position`, in the format the session asked for; None if it asked for none."""
    if hidden is None:
        return None
    if rows is not None:
        hidden = hidden[torch.tensor(rows, device=hidden.device)]
    return encode_features(hidden, position, spec.features)


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


def _settle(answer: tuple[Answer, object]) -> None:
    """`_resolve` for an awaited round's future, on its loop (or `post_rounds`'s answer slot, where its mail runs it)."""
    future, value = answer
    if not future.done():
        future.set_result(value)


def _send(mails: set[Mail | None]) -> None:
    """Hand every loop in `mails` what the step posted for it."""
    for mail in mails:
        if mail is not None:
            mail.send()


def _raised(result):
    """A blocking call's answer: the domain error it earned is raised."""
    if isinstance(result, HybridSpecError):
        raise result
    return result


async def _awaited(what: str, future: Future):
    """Await queued work from an event loop; cancelling the await cancels the work. Any exception that
    is not a domain error becomes an Internal error with a logged incident id, so a caller only ever
    sees a HybridSpecError."""
    try:
        result = await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        future.cancel()
        raise
    except Exception as exc:
        raise incident(log, exc, what) from None
    return _raised(result)
