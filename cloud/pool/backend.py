"""What the gRPC front door needs from the verifiers behind it, and the in-process implementation.

A backend speaks the wire dataclasses (never protobuf) and raises the domain errors. `Backend` holds
what every backend shares — issuing session ids, routing each session to the replica holding its
cache, per-client limits (cloud/pool/routing.py) — and leaves the calls to one replica to subclasses:
`InProcessBackend` here (one Verifier in the front door's process: tests, single-box use, and the
baseline for the Ray hop's cost) and `RayPool` in pool.py (the production pool). A backend may name,
per replica, a direct Verify endpoint that the session's rounds can go to instead of the front door
(`SessionOpened.verify_address`); `ReplicaEndpointBackend` is what such an endpoint serves. Cloud-only
generation is written once, on top of any backend: `generate_tokens` (a session of its own, the
`Generate` RPC) and `decode_tokens` (on a session the client opened, the `Decode` RPC, which a
replica's own endpoint serves too).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from ...common.security.credentials import Identity
from ...common.protocol.errors import FailedPrecondition, HybridSpecError, ResourceExhausted, Unavailable
from ...common.protocol.wire import (DecodeSpec, DraftBlock, GenerateSpec, Mode, ModelInfo, SessionOpened,
                                     SessionSpec, VerifyResult, check_context)
from ..core.prefixes import PrefixStats
from ..core.telemetry import Tally
from ..core.scheduler import DEFAULT_MAX_BATCH, DEFAULT_MAX_WAIT_MS, DEFAULT_PREFILL_BUDGET_MS, Scheduler
from .routing import SessionTable
from ..core.telemetry import ReplicaTelemetry
from ..core.verifier import Verifier, VerifierStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as the metrics see it."""

    name: str
    alive: bool
    sessions: int
    cached_tokens: int
    evictions: int  # sessions the replica dropped (idle or LRU) since it started
    failures: int = 0  # times the pool saw this replica die
    routed_total: int = 0  # sessions ever routed to this replica
    direct: Tally = Tally()  # rounds, tokens and errors its own endpoint answered since the last status
    telemetry: ReplicaTelemetry | None = None  # its own histograms and KV fill (None while it is down)
    prefixes: PrefixStats = PrefixStats()  # its prefix reuse since it started
    parked_tokens: int = 0  # tokens of its idle sessions parked in host memory


class ReplicaLost(FailedPrecondition):
    """The replica holding the session died: the edge re-opens and lands on a live one."""


class Backend(ABC):
    """Session ids and routing over named replicas; subclasses make the calls to one replica."""

    def __init__(self, max_sessions_per_client: int, max_sessions_per_address: int) -> None:
        """The session limits over every replica: per token identity, and per address without a token."""
        self.info: ModelInfo | None = None  # set once the models are loaded
        self.table = SessionTable(max_sessions_per_client, max_sessions_per_address)
        self.routed_total: dict[str, int] = {}  # replica -> sessions ever routed there

    # ---- what a front door calls --------------------------------------------------------------

    @abstractmethod
    async def start(self) -> None:
        """Load models; the front door reports SERVING only after this returns."""

    @abstractmethod
    async def stop(self) -> None:
        """Release replicas."""

    def model_info(self) -> ModelInfo:
        """What is served; Unavailable while the models are still loading."""
        if self.info is None:
            raise Unavailable("the verifier is still loading its model; retry shortly")
        return self.info

    async def open_session(self, spec: SessionSpec, caller: Identity) -> SessionOpened:
        """Open a session for `caller`, or re-open the live session spec.session_id names (its owner only).

        The session counts towards the caller's limit from the start and records the caller as its
        owner. Everything is checked before a replica is asked; an open that fails, times out or is
        abandoned leaves nothing behind.
        """
        info = self.model_info()
        session_id, route = self.table.claim(spec.session_id, caller)
        spec = replace(spec, session_id=session_id, owner=caller.owner)
        try:
            spec.check_against(info)
            for _ in range(len(self._replica_names()) + 1):  # a replica may die under us: try another
                if not route.replica:
                    route.replica = await self._place()
                    self.routed_total[route.replica] = self.routed_total.get(route.replica, 0) + 1
                route.opening = True
                try:
                    opened = await self._open_on(route.replica, spec)
                except ReplicaLost:
                    route.replica = ""  # the replica took the session with it: place it again
                    self._check_still_routed(session_id, route)
                    continue
                route.opening, route.routed_at = False, time.monotonic()
                self._check_still_routed(session_id, route)
                # The replica's answer (length, asked-for features) plus where the rounds go.
                return replace(opened, session_id=session_id, verify_address=self._verify_address(route.replica))
            raise Unavailable("no verifier replica could open the session; retry shortly")
        except BaseException:  # an error, the call's deadline, or a client that went away
            if self.table.lookup(session_id) is route:
                self.table.remove(session_id)
            if route.replica:
                self._close_quietly(route.replica, session_id)  # it may have opened there meanwhile
            raise

    def _check_still_routed(self, session_id: str, route) -> None:
        if self.table.lookup(session_id) is not route:
            raise FailedPrecondition("the session was closed while it was being opened")

    async def verify(self, block: DraftBlock, caller: Identity) -> VerifyResult:
        """Verify one round, sent by `caller`, on the replica that holds the session."""
        route = self.table.get(block.session_id, caller)
        return await self._verify_on(route.replica, replace(block, owner=caller.owner))

    async def decode(self, block: DraftBlock, max_tokens: int, eos: frozenset[int],
                     caller: Identity) -> AsyncIterator[int]:
        """Cloud-only decoding on the replica that holds the session: up to `max_tokens` tokens from
        the empty block `block`, streamed as the replica decodes them (cloud/core/decoding.py)."""
        route = self.table.get(block.session_id, caller)
        async for token in self._decode_on(route.replica, replace(block, owner=caller.owner), max_tokens, eos):
            yield token

    async def close_session(self, session_id: str, caller: Identity) -> bool:
        """Free a session (its owner only); True if it existed."""
        if self.table.lookup(session_id) is None:
            return False
        self.table.get(session_id, caller)  # PermissionDenied for another identity's session
        route = self.table.remove(session_id)
        if route is None:
            return False
        try:
            return await self._close_on(route.replica, session_id)
        except HybridSpecError:
            return False  # a soft cache: the replica expires it on its own

    async def status(self) -> list[ReplicaStatus]:
        """Per-replica state for the metrics; also drops routes of sessions replicas no longer hold."""
        async def one(name: str) -> ReplicaStatus:
            asked_at = time.monotonic()
            stats = await self._stats_of(name)
            failures = self._failures(name)
            if stats is None:
                return ReplicaStatus(name, False, 0, 0, 0, failures, self.routed_total.get(name, 0))
            held = set(stats.session_ids)
            self.table.reconcile(name, held, asked_at)
            for orphan in self.table.unrouted(name, held):  # held there, routed nowhere: free it
                self._close_quietly(name, orphan)
            return ReplicaStatus(name, True, stats.sessions, stats.cached_tokens, stats.evictions, failures,
                                 self.routed_total.get(name, 0), await self._tally_of(name), stats.telemetry,
                                 stats.prefixes, stats.parked_tokens)

        return list(await asyncio.gather(*(one(name) for name in self._replica_names())))

    # ---- what a subclass provides -------------------------------------------------------------

    @abstractmethod
    def _replica_names(self) -> list[str]:
        """Every replica, alive or not."""

    @abstractmethod
    async def _place(self) -> str:
        """The replica a new session goes to (Unavailable if none can take it)."""

    @abstractmethod
    async def _open_on(self, replica: str, spec: SessionSpec) -> SessionOpened:
        """Open on that replica; ReplicaLost if it died."""

    @abstractmethod
    async def _verify_on(self, replica: str, block: DraftBlock) -> VerifyResult:
        """Verify on that replica; ReplicaLost if it died."""

    @abstractmethod
    def _decode_on(self, replica: str, block: DraftBlock, max_tokens: int, eos: frozenset[int]) -> AsyncIterator[int]:
        """Decode there (an async generator); ReplicaLost if it died."""

    @abstractmethod
    async def _close_on(self, replica: str, session_id: str) -> bool:
        """Close on that replica."""

    @abstractmethod
    async def _stats_of(self, replica: str) -> VerifierStats | None:
        """That replica's stats, or None if it is not answering."""

    def _failures(self, replica: str) -> int:
        """Times that replica died (0 where replicas cannot die on their own)."""
        return 0

    def _verify_address(self, replica: str) -> str:
        """Where that replica takes its sessions' rounds directly; "" = through this front door."""
        return ""

    async def _tally_of(self, replica: str) -> Tally:
        """What that replica's direct endpoint answered since the last call (nothing without one)."""
        return Tally()

    def _close_quietly(self, replica: str, session_id: str) -> None:
        async def close() -> None:
            with contextlib.suppress(HybridSpecError):
                await self._close_on(replica, session_id)

        asyncio.get_running_loop().create_task(close())


class InProcessBackend(Backend):
    """One Verifier in this process, with the same round batching as a Ray replica."""

    NAME = "in-process"

    def __init__(self, verifier: Verifier, max_batch: int = DEFAULT_MAX_BATCH, max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
                 max_sessions_per_client: int | None = None, max_sessions_per_address: int | None = None,
                 prefill_budget_ms: float = DEFAULT_PREFILL_BUDGET_MS) -> None:
        """Session limits left None: as many as the verifier holds."""
        super().__init__(max_sessions_per_client or verifier.limits.max_sessions,
                         max_sessions_per_address or verifier.limits.max_sessions)
        self.verifier = verifier
        self.info = verifier.info
        self._scheduler: Scheduler | None = None
        self._batching = (max_batch, max_wait_ms, prefill_budget_ms)

    async def start(self) -> None:
        """Nothing to load: the verifier came loaded."""
        self._scheduler = Scheduler(self.verifier, *self._batching)

    async def stop(self) -> None:
        """Stop batching."""
        if self._scheduler is not None:
            await self._scheduler.aclose()

    def _replica_names(self) -> list[str]:
        return [self.NAME]

    async def _place(self) -> str:
        return self.NAME

    async def _open_on(self, replica: str, spec: SessionSpec) -> SessionOpened:
        return await self._live().open_session(spec)

    async def _verify_on(self, replica: str, block: DraftBlock) -> VerifyResult:
        return await self._live().verify(block)

    async def _decode_on(self, replica: str, block: DraftBlock, max_tokens: int,
                         eos: frozenset[int]) -> AsyncIterator[int]:
        async for token in self._live().decode(block, max_tokens, eos):
            yield token

    async def _close_on(self, replica: str, session_id: str) -> bool:
        return await self._live().close_session(session_id)

    async def _stats_of(self, replica: str) -> VerifierStats | None:
        return await self._live().stats()

    def _live(self) -> Scheduler:
        if self._scheduler is None:
            raise Unavailable("the verifier is not started")
        return self._scheduler


class ReplicaEndpointBackend(InProcessBackend):
    """A replica's own scheduler, as its direct endpoint serves it (cloud/api/server.py).

    Sessions reach that scheduler only through the front door, which issued their ids and routed them
    there; so no second routing table is kept: its verifier is the authority, answering
    FAILED_PRECONDITION for any id it does not hold, whoever presents it. Only `verify` and `decode`
    are served.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler.verifier)
        self._scheduler = scheduler

    async def verify(self, block: DraftBlock, caller: Identity) -> VerifyResult:
        """Verify one round, sent by `caller`, of a session this replica holds (the verifier checks
        that the session is the caller's)."""
        return await self._live().verify(replace(block, owner=caller.owner))

    async def decode(self, block: DraftBlock, max_tokens: int, eos: frozenset[int],
                     caller: Identity) -> AsyncIterator[int]:
        """Cloud-only decoding of a session this replica holds, straight from its scheduler."""
        async for token in self._live().decode(replace(block, owner=caller.owner), max_tokens, eos):
            yield token


async def decode_tokens(backend: Backend, spec: DecodeSpec, caller: Identity) -> AsyncIterator[int]:
    """Cloud-only decoding on a session the caller opened: its tokens as the replica decodes them, from
    the front door (routed) or from the replica's own endpoint (ReplicaEndpointBackend). Validated
    before anything is decoded."""
    info = backend.model_info()
    spec.validate(info.max_context)
    first = DraftBlock(spec.session_id, spec.round, spec.committed_len, ())  # an empty round: the first token
    async for token in backend.decode(first, spec.max_new_tokens, frozenset(info.eos_token_ids), caller):
        yield token


async def generate_tokens(backend: Backend, spec: GenerateSpec, caller: Identity) -> AsyncIterator[int]:
    """Cloud-only decoding: the target alone, one token per round of an empty draft.

    Every token is the 'bonus' of an empty block, so cloud-only streams are batched with the
    verification rounds of other sessions, and a lost replica is recovered from the tokens so far.
    The replica queues each next round itself (`Backend.decode`), so no token waits on this loop.
    Sampling draws as the coupled rule does, by (seed, absolute position): a seed gives the same
    tokens however a generation is split between hybrid rounds and streams (docs/design.md §2.2).
    """
    info = backend.model_info()
    spec.validate(info.vocab_size)
    check_context(len(spec.prompt_ids), spec.max_new_tokens, info.max_context)
    session = SessionSpec(session_id="", committed_ids=tuple(spec.prompt_ids), sampling=spec.sampling,
                          mode=Mode.GREEDY if spec.sampling.greedy else Mode.COUPLED,
                          seed=spec.seed, tokenizer_fingerprint=spec.tokenizer_fingerprint,
                          prompt_len=spec.prompt_end)
    committed = list(spec.prompt_ids)
    session_id = (await backend.open_session(session, caller)).session_id
    eos = frozenset(info.eos_token_ids)
    reopened_at = -1  # a session lost twice without a token in between is an error, not a retry
    try:
        while (generated := len(committed) - len(spec.prompt_ids)) < spec.max_new_tokens:
            block = DraftBlock(session_id, generated, len(committed), ())
            try:
                async for token in backend.decode(block, spec.max_new_tokens - generated, eos, caller):
                    committed.append(token)
                    yield token
                    if token in eos:
                        return
            except FailedPrecondition:  # evicted, or its replica was lost: re-open from the tokens so far
                if reopened_at == generated:
                    raise
                reopened_at = generated
                reopen = replace(session, session_id=session_id, committed_ids=tuple(committed), next_round=generated)
                session_id = (await backend.open_session(reopen, caller)).session_id
    finally:
        await backend.close_session(session_id, caller)
