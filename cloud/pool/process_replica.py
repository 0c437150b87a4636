"""A verifier replica in a process of its own beside the front door, so that gRPC and the model loop
no longer share one interpreter.

In one process, the front door's event loop (grpc.aio reading and writing every message, the
servicer, routing, metrics) and the model thread take turns holding the interpreter: at 64 edges that
work is most of a step's host time, and all of it lies on the step's critical path
(docs/measurements.md). Here the verifier runs in a spawned child (a fresh interpreter, none of the
parent's threads or gRPC state) and the two talk over one pipe in batches: the front door sends what
its event loop queued in one turn as one message, and the child answers a step's rounds in one message
at the step's end. vLLM's engine-core process and SGLang's scheduler process split a server the same
way. Only wire dataclasses cross the pipe (pickled: both ends are this program); the child never
sees protobuf and the front door never imports torch.

The child's round path takes no event loop: its reader thread queues the rounds of each message on the
verifier under one lock (`Verifier.post_rounds`), each with an answer slot lighter than a Future, and
the stepping thread writes a step's answers to the pipe itself, in one message, at the step's end.
Opens, closes, stats and decode streams run on the child's event loop through the verifier's awaited
calls, and a writer thread sends their answers. When the child dies, every call in flight fails with
ReplicaLost (its sessions died with it) and a new child starts; edges re-open their sessions, as they
do when Ray restarts a replica.
"""
from __future__ import annotations

import asyncio
import enum
import functools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from ...common.protocol.errors import HybridSpecError, Unavailable, incident
from ...common.protocol.wire import (DraftBlock, ModelInfo, OpenProgress, SessionOpened, SessionSpec, VerifyResult,
                                     opened_from)
from ..core.heap import settle_heap
from ..core.telemetry import ClockSwitch, StepClock, Tally
from .pool import CHECK_S, REPLICA_SILENT_S, Pool, ReplicaLost, ReplicaSilent
from .loading import load_verifier
from .specs import ReplicaSpec

if TYPE_CHECKING:
    from ..core.verifier import Verifier, VerifierStats

log = logging.getLogger(__name__)

STOP_S = 35.0  # the child's own stop waits up to 30 s for the current step (Verifier._halt)
RESTART_PAUSE_S = 1.0  # between attempts to start a child that failed to load


class Msg(enum.IntEnum):
    """A message's kind. Each message on the pipe is (kind, key, payload); the key pairs a request with
    its answer (0 for the child's own reports)."""

    VERIFY = 1  # -> a round (DraftBlock)
    OPEN = 2  # -> SessionSpec; answered by ITEMs (OpenProgress), then the SessionOpened
    DECODE = 3  # -> (DraftBlock, max_tokens, eos); answered by ITEMs (tokens), then None
    CLOSE = 4  # -> session id
    STATS = 5
    CLOCK = 6  # -> True: start a StepClock; False: stop it and answer (clock, the child's CPU seconds)
    CANCEL = 7  # the caller left: drop the request `key`
    STOP = 8
    ANSWER = 9  # <- the request's last answer: its value, or the domain error it earned
    ITEM = 10  # <- one item of a streamed answer
    READY = 11  # <- the model is loaded and the verifier started: its ModelInfo
    FAILED = 12  # <- loading failed: one line saying why
    INFO = 13  # <- the ModelInfo again, now with the measured pass-cost curve


@dataclass(frozen=True)
class _Final:
    """A stream's last item: its answer (None for a decode stream's end) or its error."""

    value: object


class _Outbox:
    """Messages queued on an event loop's thread, handed to `write` as one batch per turn of the loop."""

    def __init__(self, write: Callable[[list], None]) -> None:
        self._write = write
        self._batch: list[tuple[int, int, object]] = []

    def add(self, kind: Msg, key: int, value: object) -> None:
        if not self._batch:
            asyncio.get_running_loop().call_soon(self.flush)
        self._batch.append((kind.value, key, value))

    def flush(self) -> None:
        """Write what is queued now."""
        batch, self._batch = self._batch, []
        if batch:
            self._write(batch)

    def clear(self) -> None:
        self._batch.clear()


# What the child runs to get its verifier: given the callback to run once the verifier's pass-cost curve
# is in its `info`, the loaded verifier. Picklable (the child is spawned): a module-level function or a
# functools.partial of one, as `functools.partial(load_verifier, spec)`.
Loader = Callable[[Callable[[ModelInfo], None]], "Verifier"]


def process_pool(load: Loader | ReplicaSpec, max_sessions_per_client: int, max_sessions_per_address: int,
                 replica_wait_s: float = 0.0) -> Pool:
    """The pool over one verifier replica in a process of its own, named "process" (`cloud serve --backend
    process`: `load` is the replica's spec; a benchmark passes a loader of its own)."""
    if isinstance(load, ReplicaSpec):
        load = functools.partial(load_verifier, load)
    return Pool([ProcessReplica("process", load)], max_sessions_per_client, max_sessions_per_address, replica_wait_s)


class ProcessReplica:
    """A `Replica` (cloud/pool/pool.py) whose verifier runs in a child process; lives on the event loop of
    the front door, or of the Ray actor whose model it runs (cloud/pool/replica.py), whose own endpoint it
    then serves as a verifier would (`Decoder`, cloud/api/service.py)."""

    verify_address = ""  # its rounds come through the front door
    paces = False  # whoever serves it charges its callers' rates

    def __init__(self, name: str, load: Loader, *, measured: Callable[[ModelInfo], None] | None = None,
                 lost: Callable[[], None] | None = None) -> None:
        """`measured(info)` runs when the child reports its measured pass-cost curve; `lost()` runs when a
        serving child exits, in place of starting another (a Ray actor then exits, for Ray to restart)."""
        self.name = name
        self.load = load
        self._measured, self._lost = measured, lost
        self.alive = False  # until the child has its model loaded
        self.answering = True
        self.failures = 0  # times the child died
        self.info: ModelInfo | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: Connection | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._ready: asyncio.Future | None = None  # the current child's READY (or failure)
        self._waiting: dict[int, asyncio.Future | asyncio.Queue] = {}  # request key -> its answer's waiter
        self._keys = iter(range(1, 1 << 62))
        self._outbox = _Outbox(self._write)
        self._back = asyncio.Event()
        self._restarting: asyncio.Task | None = None
        self._stopped = False

    # ---- the Replica protocol ------------------------------------------------------------------

    async def start(self) -> ModelInfo:
        """Start the child and wait until its model is loaded; Unavailable (one line) if it cannot load."""
        self._loop = asyncio.get_running_loop()
        return await self._spawn()

    def model_info(self) -> ModelInfo:
        """What it serves, as the child last said (with the pass-cost curve once measured)."""
        assert self.info is not None, "a replica's model info is asked for before it started"
        return self.info

    async def stop(self) -> None:
        """Stop the child for good: its verifier fails what is queued, then it exits (killed if it hangs)."""
        self._stopped, self.alive = True, False
        if self._restarting is not None:
            self._restarting.cancel()
        process, conn = self._process, self._conn
        if conn is not None:
            self._outbox.add(Msg.STOP, 0, None)
            self._outbox.flush()
        if process is not None:
            await asyncio.to_thread(process.join, STOP_S)
            if process.is_alive():
                log.warning("replica %s did not stop in %.0f s; killing it", self.name, STOP_S)
                process.kill()
                await asyncio.to_thread(process.join, 5)
        self._gone(Unavailable("the verifier is shutting down"))

    async def wait_alive(self) -> None:
        """Return once a child is serving (at once if one is)."""
        await self._back.wait()

    async def aopen_session(self, spec: SessionSpec,
                            progress: Callable[[OpenProgress], None] | None = None) -> SessionOpened:
        """Open or re-open a session in the child: `progress` told how far it has got every second, then its
        answer (`aopen_progress`)."""
        return await opened_from(self.aopen_progress(spec), progress)

    async def aopen_progress(self, spec: SessionSpec) -> AsyncIterator[OpenProgress | SessionOpened]:
        """Open or re-open a session in the child, as the verifier's own `aopen_progress`: how far it has got
        every second, then its answer; ReplicaSilent, the open abandoned, if the child says nothing for
        REPLICA_SILENT_S."""
        key, items = self._stream(Msg.OPEN, spec)
        try:
            while True:
                try:
                    item = await asyncio.wait_for(items.get(), REPLICA_SILENT_S)
                except asyncio.TimeoutError:
                    self.answering = False
                    raise ReplicaSilent(f"the verifier replica stopped answering: nothing for {REPLICA_SILENT_S:g} s "
                                        "while it had the prompt") from None
                self.answering = True
                if isinstance(item, _Final):
                    yield _raised(item.value)
                    return
                yield item
        finally:
            self._abandon(key)

    async def averify(self, block: DraftBlock) -> VerifyResult:
        """Verify one round in the child's next step; cancelling the await cancels the round."""
        key, answer = self._request(Msg.VERIFY, block)
        try:
            return _raised(await answer)
        finally:
            self._abandon(key)

    async def adecode(self, block: DraftBlock, max_tokens: int, eos: frozenset[int]) -> AsyncIterator[int]:
        """Cloud-only decoding in the child, each token as its step decodes it."""
        key, items = self._stream(Msg.DECODE, (block, max_tokens, eos))
        try:
            while not isinstance(item := await items.get(), _Final):
                yield item
            _raised(item.value)
        finally:
            self._abandon(key)

    async def aclose_session(self, session_id: str) -> bool:
        """Free a session in the child (nothing to free in a dead one)."""
        if not self.alive:
            return False
        key, answer = self._request(Msg.CLOSE, session_id)
        try:
            return _raised(await answer)
        finally:
            self._abandon(key)

    async def astats(self) -> VerifierStats | None:
        """The child's stats, or None if it is down or does not answer within CHECK_S."""
        if not self.alive:
            return None
        key, answer = self._request(Msg.STATS, None)
        try:
            stats = _raised(await asyncio.wait_for(answer, CHECK_S))
        except ReplicaLost:
            raise
        except (asyncio.TimeoutError, HybridSpecError):
            return None  # a slow stats call on a busy host bars no new session; only an open's silence does
        finally:
            self._abandon(key)
        self.answering = True
        return stats

    async def take_tally(self) -> Tally:
        """Nothing: no endpoint of its own."""
        return Tally()

    async def step_clock(self, on: bool) -> tuple[StepClock, float] | None:
        """Start timing the child's steps part by part (on), or stop and return the clock and the child's
        process CPU seconds since it started (bench/hop_overhead.py --host --backend process)."""
        key, answer = self._request(Msg.CLOCK, on)
        try:
            return _raised(await answer)
        finally:
            self._abandon(key)

    # ---- the child's life -------------------------------------------------------------------------

    async def _spawn(self) -> ModelInfo:
        """Start a child and wait for its READY."""
        context = multiprocessing.get_context("spawn")  # no fork of a process running threads and gRPC
        ours, theirs = context.Pipe()
        # Not a daemon: a daemonic process may not start processes of its own, and loading a GGUF file the
        # first time does. The child exits when this end of the pipe closes, however this process ends.
        process = context.Process(target=serve_child, args=(theirs, self.load, logging.getLogger().level),
                                  name=f"hybridspec-{self.name}")
        await asyncio.to_thread(process.start)
        theirs.close()
        self._conn, self._process = ours, process
        self._ready = self._loop.create_future()
        self._loop.add_reader(ours.fileno(), self._on_readable)
        try:
            self.info = await self._ready
        except BaseException:  # it failed to load, or the start was given up: no child is left behind
            self._gone(Unavailable("the verifier is not started"))
            if process.is_alive():
                process.kill()
            await asyncio.to_thread(process.join, 5)
            raise
        self.alive, self.answering = True, True
        self._back.set()
        return self.info

    def _on_readable(self) -> None:
        """Read every batch the child has written; its death when the pipe closes."""
        conn = self._conn
        try:
            while conn.poll():
                for kind, key, value in pickle.loads(conn.recv_bytes()):
                    self._take(kind, key, value)
        except (EOFError, OSError):
            self._died()

    def _take(self, kind: int, key: int, value: object) -> None:
        if kind == Msg.ANSWER:
            waiter = self._waiting.pop(key, None)
            if isinstance(waiter, asyncio.Queue):
                waiter.put_nowait(_Final(value))
            elif waiter is not None and not waiter.done():
                waiter.set_result(value)
        elif kind == Msg.ITEM:
            waiter = self._waiting.get(key)
            if isinstance(waiter, asyncio.Queue):
                waiter.put_nowait(value)
        elif kind == Msg.INFO:
            self.info = value
            if self._measured is not None:
                self._measured(value)
        elif kind == Msg.READY:
            self._ready.set_result(value)
        elif kind == Msg.FAILED:
            self._ready.set_exception(Unavailable(f"the verifier could not load its model: {value}"))

    def _died(self) -> None:
        """The pipe closed: the child exited. Fail what waits on it and, if it was serving, start another."""
        if self._conn is None:
            return
        serving, code = self.alive, self._process.exitcode if self._process is not None else None
        self._gone(ReplicaLost())
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(Unavailable(f"the verifier process exited while loading its model (exit code "
                                                  f"{code}); the server log says why"))
        if not serving or self._stopped:
            return
        if self._lost is not None:
            self._lost()
            return
        self.failures += 1
        log.warning("replica %s exited (exit code %s); starting a new one", self.name, code)
        self._restarting = self._loop.create_task(self._restart())

    def _gone(self, error: HybridSpecError) -> None:
        """The current child is gone: nothing more is read from it, and every waiter gets `error`."""
        self.alive = False
        self._back.clear()
        if self._conn is not None:
            self._loop.remove_reader(self._conn.fileno())
            self._conn.close()
            self._conn = None
        self._outbox.clear()
        waiting, self._waiting = self._waiting, {}
        for waiter in waiting.values():
            if isinstance(waiter, asyncio.Queue):
                waiter.put_nowait(_Final(error))
            elif not waiter.done():
                waiter.set_result(error)

    async def _restart(self) -> None:
        while not self._stopped:
            try:
                await self._spawn()
                log.info("replica %s is back", self.name)
                return
            except Exception as exc:  # noqa: BLE001 — a child that cannot start now may later: keep trying
                log.warning("replica %s could not start (%s); trying again", self.name, exc)
                await asyncio.sleep(RESTART_PAUSE_S)

    # ---- requests ------------------------------------------------------------------------------

    def _request(self, kind: Msg, payload: object) -> tuple[int, asyncio.Future]:
        """Send a request; its answer's future (ReplicaLost as its value if the child is down)."""
        key, answer = next(self._keys), self._loop.create_future()
        if not self.alive:
            answer.set_result(ReplicaLost())
            return key, answer
        self._waiting[key] = answer
        self._outbox.add(kind, key, payload)
        return key, answer

    def _stream(self, kind: Msg, payload: object) -> tuple[int, asyncio.Queue]:
        """Send a request answered by a stream of items, then a _Final."""
        key, items = next(self._keys), asyncio.Queue()
        if not self.alive:
            items.put_nowait(_Final(ReplicaLost()))
            return key, items
        self._waiting[key] = items
        self._outbox.add(kind, key, payload)
        return key, items

    def _abandon(self, key: int) -> None:
        """The caller is done with `key`: if it is still answering, the child drops it."""
        if self._waiting.pop(key, None) is not None:
            self._outbox.add(Msg.CANCEL, key, None)

    def _write(self, batch: list[tuple[int, int, object]]) -> None:
        if self._conn is None:
            return  # the child is gone: its waiters have their error
        try:
            self._conn.send_bytes(pickle.dumps(batch, pickle.HIGHEST_PROTOCOL))
        except OSError:
            self._died()


def _raised(value):
    """A request's answer: the domain error it earned is raised."""
    if isinstance(value, HybridSpecError):
        raise value
    return value


# ---- the child ---------------------------------------------------------------------------------------


class StepMail:
    """The child's mail for the rounds the front door sent (cloud/core/verifier.py `Mail`): the step posts
    each answer, and `send`, at the step's end on the stepping thread, writes them to the pipe as one batch."""

    closed = False  # answers always have somewhere to go

    def __init__(self, put: Callable[[list], None]) -> None:
        self._put = put
        self._posted: list[tuple[Callable[[object], None], object]] = []
        self.batch: list[tuple[int, int, object]] = []  # what the posted calls answered (`_Ticket.set_result`)

    def post(self, fn: Callable[[object], None], arg: object) -> None:
        """Run fn(arg) at the next `send`."""
        self._posted.append((fn, arg))

    def send(self) -> None:
        """Run what was posted and write its answers."""
        posted, self._posted = self._posted, []
        for fn, arg in posted:
            fn(arg)
        batch, self.batch = self.batch, []
        if batch:
            self._put(batch)


class _Ticket:
    """A round's answer slot (cloud/core/verifier.py `Answer`): settled into its mail's batch on the stepping
    thread, cancelled by the reader thread when the front door's caller left. A Future costs several times
    as much per round: its lock, its condition, its callbacks."""

    __slots__ = ("key", "mail", "tickets", "_cancelled")

    def __init__(self, key: int, mail: StepMail, tickets: dict[int, _Ticket]) -> None:
        self.key, self.mail, self.tickets, self._cancelled = key, mail, tickets, False

    def cancel(self) -> None:
        self._cancelled = True

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._cancelled or self.key not in self.tickets

    def set_result(self, result: object) -> None:
        if self.tickets.pop(self.key, None) is not None:
            self.mail.batch.append((Msg.ANSWER.value, self.key, result))


def serve_child(conn: Connection, load: Loader, log_level: int) -> None:
    """The child process: load the verifier, report READY, serve the pipe until STOP or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent stops us
    logging.basicConfig(level=log_level or logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(_Child(conn).serve(load))


class _Child:
    """The child's side of the pipe: a reader thread, a writer thread, the verifier, and an event loop for
    everything but rounds."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.out: queue.SimpleQueue[list | None] = queue.SimpleQueue()  # batches for the writer
        self.mail = StepMail(self._send)  # a step's answers are written by the stepping thread itself
        self._sending = threading.Lock()
        self.rounds: dict[int, _Ticket] = {}  # request key -> its round's answer slot, until answered or cancelled
        self.calls: dict[int, asyncio.Task] = {}  # request key -> its call's task (the event loop's)
        self.verifier: Verifier | None = None
        self.stopped = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox = _Outbox(self.out.put)  # the event loop's messages, for the writer thread
        self._clock = ClockSwitch()

    async def serve(self, load: Loader) -> None:
        writer = threading.Thread(target=self._write, name="replica-pipe-writer", daemon=True)
        writer.start()
        try:
            try:
                self.verifier = load(lambda info: self.out.put([(Msg.INFO.value, 0, info)]))
            except Exception as exc:  # noqa: BLE001 — the parent reports it as one line
                self.out.put([(Msg.FAILED.value, 0, str(exc) or type(exc).__name__)])
                return
            await self.verifier.start()
            settle_heap()
            self._loop = asyncio.get_running_loop()
            self.out.put([(Msg.READY.value, 0, self.verifier.info)])
            threading.Thread(target=self._read, name="replica-pipe-reader", daemon=True).start()
            await self.stopped.wait()
            for task in list(self.calls.values()):
                task.cancel()
            await self.verifier.stop()
        finally:
            self.out.put(None)
            writer.join(timeout=5)

    def _read(self) -> None:
        """The reader thread: a blocking read (no event loop's turn per batch); rounds go straight to the
        verifier's queue, everything else to the event loop."""
        while True:
            try:
                batch = pickle.loads(self.conn.recv_bytes())
                while self.conn.poll():  # what else has arrived meanwhile joins it: one wake-up of the verifier
                    batch += pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                self._loop.call_soon_threadsafe(self.stopped.set)  # the parent is gone
                return
            rounds, others = [], []
            for kind, key, payload in batch:
                if kind == Msg.VERIFY:
                    ticket = self.rounds[key] = _Ticket(key, self.mail, self.rounds)
                    rounds.append((payload, ticket))
                elif kind == Msg.CANCEL and (ticket := self.rounds.pop(key, None)) is not None:
                    ticket.cancel()
                else:  # a call's cancel goes to the event loop, which holds its task
                    others.append((kind, key, payload))
            if rounds:
                try:
                    self.verifier.post_rounds(rounds, self.mail)
                except HybridSpecError as exc:  # shutting down
                    self.out.put([(Msg.ANSWER.value, ticket.key, exc) for _, ticket in rounds
                                  if self.rounds.pop(ticket.key, None) is not None])
            if others:
                self._loop.call_soon_threadsafe(self._take, others)

    def _take(self, messages: list[tuple[int, int, Any]]) -> None:
        """Every message but a round's, on the event loop."""
        for kind, key, payload in messages:
            if kind == Msg.CANCEL:
                task = self.calls.pop(key, None)
                if task is not None:
                    task.cancel()
            elif kind == Msg.STOP:
                self.stopped.set()
            else:
                self.calls[key] = self._loop.create_task(self._call(kind, key, payload))

    async def _call(self, kind: int, key: int, payload: Any) -> None:
        """Every request but a round, on the verifier's awaited calls; its answer (or domain error) goes back."""
        verifier = self.verifier
        try:
            if kind == Msg.OPEN:
                async for item in verifier.aopen_progress(payload):
                    self._outbox.add(Msg.ANSWER if isinstance(item, SessionOpened) else Msg.ITEM, key, item)
                return
            if kind == Msg.DECODE:
                async for token in verifier.adecode(*payload):
                    self._outbox.add(Msg.ITEM, key, token)
                value = None
            elif kind == Msg.CLOSE:
                value = await verifier.aclose_session(payload)
            elif kind == Msg.STATS:
                value = await verifier.astats()
            elif kind == Msg.CLOCK:
                value = self._clock.turn(verifier, payload)
            else:
                raise ValueError(f"unknown request kind {kind}")
        except HybridSpecError as exc:
            value = exc
        except asyncio.CancelledError:
            return  # the caller left; it waits for nothing
        except Exception as exc:  # noqa: BLE001 — a bug: the caller gets an incident id, the log the rest
            value = incident(log, exc, Msg(kind).name.lower())
        finally:
            self.calls.pop(key, None)
        self._outbox.add(Msg.ANSWER, key, value)

    def _write(self) -> None:
        """The writer thread, for the event loop's messages: the loop never blocks on a full pipe."""
        while (batch := self.out.get()) is not None:
            self._send(batch)

    def _send(self, batch: list[tuple[int, int, object]]) -> None:
        """Write one batch (the stepping thread's at a step's end, or the writer thread's). A full pipe
        blocks the writer only: the parent's own writes are read meanwhile by the reader thread, which
        never waits for this lock."""
        try:
            data = pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 — an answer that does not pickle is a bug; its caller hears
            error = incident(log, exc, "answering the front door")
            data = pickle.dumps([(Msg.ANSWER.value, key, error) for kind, key, _ in batch
                                 if kind in (Msg.ANSWER, Msg.ITEM)])
        with self._sending:
            try:
                self.conn.send_bytes(data)
            except OSError:
                pass  # the parent is gone; the reader sees it and stops the child
