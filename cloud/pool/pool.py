"""The verifier pool the gRPC front door calls: replicas behind one `Replica` protocol, and routing.

A `Pool` speaks the wire dataclasses (never protobuf) and raises the domain errors. It does once what
every kind of replica needs: issuing session ids, placing each new session and routing its calls to
the replica holding its cache, per-client limits (the `SessionTable`, cloud/pool/routing.py),
forgetting the sessions of a replica that died, and reporting each replica's state. A replica is
anything with the few calls of `Replica`: a Verifier in this process (cloud/core/verifier.py, itself a
`Replica`; `inprocess_pool` builds the pool over one: tests, single-box use, the baseline for the Ray
hop's cost) or a Ray actor (cloud/pool/ray_pool.py `RayReplica`: the production pool). A replica may
name a direct Verify endpoint that its sessions' rounds can go to instead of the front door
(`SessionOpened.verify_address`). Rounds and decode steps arrive stamped with their sender's identity
(`DraftBlock.owner`, set by the servicer, cloud/api/service.py), which is checked against the
session's before they are routed. An awaited replica call carries an `a` (`averify`), like its
blocking twin on a Verifier.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from ...common.protocol.errors import FailedPrecondition, HybridSpecError, Unavailable
from ...common.protocol.wire import (PROGRESS_EVERY_S, DraftBlock, ModelInfo, OpenProgress, SessionOpened, SessionSpec,
                                     VerifyResult)
from ...common.security.credentials import Identity
from ..core.prefixes import PrefixStats
from ..core.telemetry import ReplicaTelemetry, Tally
from .routing import Route, SessionTable

if TYPE_CHECKING:  # a Ray pool's front door serves no model: it never imports torch
    from ..core.verifier import Verifier, VerifierStats

log = logging.getLogger(__name__)


class ReplicaLost(FailedPrecondition):
    """The replica holding the session died: the edge re-opens and lands on a live one."""

    def __init__(self, message: str = "the replica holding the session was lost; re-open it",
                 retry_after_s: float | None = None) -> None:
        super().__init__(message, retry_after_s)


class ReplicaSilent(Unavailable):
    """A replica said nothing for REPLICA_SILENT_S during an open (a stopped process, a hung host): it
    takes no new sessions until it answers again, and the open is placed on another replica."""


# An open's replica reports its progress every second (cloud/core/verifier.py PROGRESS_S): this long
# without a word, it is taken as not answering. Well below the edge's own timeout, so the edge gets this
# clear error (or a fail-over) in seconds instead of waiting for a deadline scaled to its prompt.
REPLICA_SILENT_S = 4 * PROGRESS_EVERY_S
# A replica's status call (its stats, its endpoint's tally) answered later than this counts it down in
# the metrics; it bars no new session: only an open's silence does (REPLICA_SILENT_S).
CHECK_S = 5.0


class Replica(Protocol):
    """One verifier replica, as the pool calls it. Every call speaks wire dataclasses and raises
    domain errors; `ReplicaLost` means the replica died and its sessions with it."""

    name: str

    @property
    def alive(self) -> bool:
        """False while it is down (a Ray replica being restarted)."""

    @property
    def failures(self) -> int:
        """Times it died (0 where a replica cannot die on its own)."""

    @property
    def answering(self) -> bool:
        """False while it is alive but said nothing for REPLICA_SILENT_S (it gets no new sessions)."""

    @property
    def verify_address(self) -> str:
        """Where it takes its sessions' rounds directly; "" = through the front door."""

    async def start(self) -> ModelInfo:
        """Load (or wait for) its model; returns what it serves."""

    def model_info(self) -> ModelInfo:
        """What it serves as it last said, once started: the pass-cost curve it measures after it
        started appears here once measured."""

    async def stop(self) -> None:
        """Release it for good."""

    async def wait_alive(self) -> None:
        """Return once it is alive (at once if it is)."""

    async def aopen_session(self, spec: SessionSpec,
                            progress: Callable[[OpenProgress], None] | None = None) -> SessionOpened:
        """Open or re-open a session there, telling `progress` how far it has got at least every 2 s;
        ReplicaSilent if the replica says nothing for REPLICA_SILENT_S."""

    async def averify(self, block: DraftBlock) -> VerifyResult:
        """Verify one round of a session it holds."""

    def adecode(self, block: DraftBlock, max_tokens: int, eos: frozenset[int]) -> AsyncIterator[int]:
        """Cloud-only decoding of a session it holds, from the empty block `block` (an async generator)."""

    async def aclose_session(self, session_id: str) -> bool:
        """Free a session; True if it held it."""

    async def astats(self) -> VerifierStats | None:
        """Its sessions, cache and telemetry; None if it is not answering."""

    async def take_tally(self) -> Tally:
        """What its direct endpoint answered since the last call (nothing without one)."""


class Cluster(Protocol):
    """What a pool's replicas run on, started before them and stopped after (a Ray cluster)."""

    def start(self) -> None:
        """Start or join it (on the caller's thread: Ray installs signal handlers)."""

    async def stop(self) -> None:
        """Leave it, and end it if `start` started it."""


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


class Pool:
    """Session ids, placement, routing and limits over named replicas: what the front door serves."""

    def __init__(self, replicas: Sequence[Replica], max_sessions_per_client: int, max_sessions_per_address: int,
                 replica_wait_s: float, cluster: Cluster | None = None, paces: bool = False) -> None:
        """The session limits hold over every replica: per token identity, and per address without a
        token. replica_wait_s: with every replica down, how long a new session waits for one. paces: the
        replicas charge their callers' rates themselves, so the front door must not charge them again."""
        if not replicas:
            raise ValueError("a pool needs at least one replica")
        self.replicas: dict[str, Replica] = {r.name: r for r in replicas}
        self.table = SessionTable(max_sessions_per_client, max_sessions_per_address)
        self.routed_total: dict[str, int] = {}  # replica -> sessions ever routed there
        self.info: ModelInfo | None = None  # set once the models are loaded
        self.replica_wait_s = replica_wait_s
        self.cluster = cluster
        self.paces = paces

    async def start(self) -> None:
        """Start the cluster, then every replica; the front door reports SERVING only after this
        returns. Replicas that loaded different models are refused."""
        if self.cluster is not None:
            self.cluster.start()
        try:
            infos = await asyncio.gather(*(r.start() for r in self.replicas.values()))
            if len({(i.tokenizer_fingerprint, i.model_fingerprint) for i in infos}) != 1:
                raise Unavailable("replicas loaded different models; check the target setting")
        except BaseException:
            await self.stop()
            raise
        self.info = infos[0]
        log.info("%d replica(s) ready: %s", len(self.replicas), ", ".join(self.replicas))

    async def stop(self) -> None:
        """Release the replicas, then the cluster."""
        for replica in self.replicas.values():
            await replica.stop()
        if self.cluster is not None:
            await self.cluster.stop()

    def model_info(self) -> ModelInfo:
        """What is served; Unavailable while the models are still loading. The pass-cost curve comes
        with the first replica that has one (replicas serve before theirs is measured)."""
        if self.info is None:
            raise Unavailable("the verifier is still loading its model; retry shortly")
        if not self.info.pass_costs:
            measured = next((i for i in (r.model_info() for r in self.replicas.values()) if i.pass_costs), None)
            if measured is not None:
                self.info = replace(self.info, pass_costs=measured.pass_costs,
                                    batch_pass_costs=measured.batch_pass_costs)
        return self.info

    async def open_session(self, spec: SessionSpec, caller: Identity,
                           progress: Callable[[OpenProgress], None] | None = None) -> SessionOpened:
        """Open a session for `caller`, or re-open the live session spec.session_id names (its owner only),
        telling `progress` how far the replica has got.

        The session counts towards the caller's limit from the start and records the caller as its
        owner. Everything is checked before a replica is asked; an open that fails, times out or is
        abandoned leaves nothing behind. A replica that dies or stops answering meanwhile is left for
        another (a fail-over), or, with none left, the error says so.
        """
        info = self.model_info()
        session_id, route = self.table.claim(spec.session_id, caller)
        spec = replace(spec, session_id=session_id, owner=caller.owner, tenant=caller.name, weight=caller.weight)
        try:
            spec.check_against(info)
            for _ in range(len(self.replicas) + 1):  # a replica may die under us: try another
                # 1. Place a new session (or one whose replica died) on a live replica.
                if not route.replica:
                    route.replica = await self._place()
                    self.routed_total[route.replica] = self.routed_total.get(route.replica, 0) + 1
                replica = self.replicas[route.replica]
                # 2. Open it there; if that replica dies meanwhile, place it again.
                route.opening = True
                try:
                    with self._noticing_loss(replica):
                        opened = await replica.aopen_session(spec, progress)
                except (ReplicaLost, ReplicaSilent) as exc:
                    if isinstance(exc, ReplicaSilent):
                        log.warning("replica %s stopped answering during an open; it gets no new sessions until "
                                    "it answers again", replica.name)
                        self._close_quietly(replica, session_id)  # if it wakes up, it must not keep the open
                    route.replica = ""
                    self._check_still_routed(session_id, route)
                    continue
                route.opening, route.routed_at = False, time.monotonic()
                self._check_still_routed(session_id, route)
                # 3. The replica's answer (length, asked-for features) plus where the rounds go.
                return replace(opened, session_id=session_id, verify_address=replica.verify_address)
            raise Unavailable("no verifier replica could open the session; retry shortly")
        except BaseException:  # an error, the call's deadline, or a client that went away
            if self.table.lookup(session_id) is route:
                self.table.remove(session_id)
            if route.replica:
                self._close_quietly(self.replicas[route.replica], session_id)  # it may have opened there meanwhile
            raise

    async def averify(self, block: DraftBlock) -> VerifyResult:
        """Verify one round, sent by `block.owner`, on the replica that holds the session (the table's
        `get`: FailedPrecondition for a session it does not route, PermissionDenied for another
        identity's)."""
        replica = self.replicas[self.table.get(block.session_id, block.owner).replica]
        with self._noticing_loss(replica):
            return await replica.averify(block)

    async def adecode(self, block: DraftBlock, max_tokens: int, eos: frozenset[int]) -> AsyncIterator[int]:
        """Cloud-only decoding on the replica that holds the session: up to `max_tokens` tokens from
        the empty block `block`, streamed as the replica decodes them."""
        replica = self.replicas[self.table.get(block.session_id, block.owner).replica]
        with self._noticing_loss(replica):
            async for token in replica.adecode(block, max_tokens, eos):
                yield token

    async def close_session(self, session_id: str, caller: Identity) -> bool:
        """Free a session (its owner only); True if it existed."""
        if self.table.lookup(session_id) is None:
            return False
        self.table.get(session_id, caller.owner)  # PermissionDenied for another identity's session
        route = self.table.remove(session_id)
        if route is None:
            return False
        replica = self.replicas[route.replica]
        try:
            with self._noticing_loss(replica):
                return await replica.aclose_session(session_id)
        except HybridSpecError:
            return False  # a soft cache: the replica expires it on its own

    async def status(self) -> list[ReplicaStatus]:
        """Per-replica state for the metrics; also drops routes of sessions replicas no longer hold."""
        async def one(replica: Replica) -> ReplicaStatus:
            name, asked_at = replica.name, time.monotonic()
            try:
                with self._noticing_loss(replica):
                    stats = await replica.astats()
            except ReplicaLost:
                stats = None
            routed = self.routed_total.get(name, 0)
            if stats is None:
                return ReplicaStatus(name, False, 0, 0, 0, replica.failures, routed)
            held = set(stats.session_ids)
            self.table.reconcile(name, held, asked_at)
            for orphan in self.table.unrouted(name, held):  # held there, routed nowhere: free it
                self._close_quietly(replica, orphan)
            try:
                with self._noticing_loss(replica):
                    tally = await replica.take_tally()
            except ReplicaLost:
                tally = Tally()  # those rounds go uncounted
            return ReplicaStatus(name, True, stats.sessions, stats.cached_tokens, stats.evictions, replica.failures,
                                 routed, tally, stats.telemetry, stats.prefixes, stats.parked_tokens)

        return list(await asyncio.gather(*(one(r) for r in self.replicas.values())))

    # ---- helpers ------------------------------------------------------------------------------

    async def _place(self) -> str:
        """The name of the live, answering replica a new session goes to: the one with the fewest
        sessions (ties: the one that got fewer so far); Unavailable at once if every live one stopped
        answering; with none alive, wait up to replica_wait_s for one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replica_wait_s
        while True:
            alive = [r for r in self.replicas.values() if r.alive]
            live = [r.name for r in alive if r.answering]
            if live:
                return min(live, key=lambda name: (self.table.count(name), self.routed_total.get(name, 0)))
            if alive:
                which = "every verifier replica" if len(alive) > 1 else "the verifier replica"
                raise Unavailable(f"{which} stopped answering (nothing for {REPLICA_SILENT_S:g} s during an open) "
                                  "and gets no new session until it answers again; retry shortly")
            waits = [loop.create_task(r.wait_alive()) for r in self.replicas.values()]
            try:
                done, _ = await asyncio.wait(waits, timeout=max(0.0, deadline - loop.time()),
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
            if not done:
                raise Unavailable("no verifier replica is alive; Ray is restarting them, retry shortly")

    def _check_still_routed(self, session_id: str, route: Route) -> None:
        if self.table.lookup(session_id) is not route:
            raise FailedPrecondition("the session was closed while it was being opened")

    @contextlib.contextmanager
    def _noticing_loss(self, replica: Replica) -> Iterator[None]:
        """Forget the sessions of `replica` when a call finds it dead (the ReplicaLost goes on up)."""
        try:
            yield
        except ReplicaLost:
            self.table.lost(replica.name)
            raise

    def _close_quietly(self, replica: Replica, session_id: str) -> None:
        async def close() -> None:
            with contextlib.suppress(HybridSpecError), self._noticing_loss(replica):
                await replica.aclose_session(session_id)

        asyncio.get_running_loop().create_task(close())


def inprocess_pool(verifier: Verifier, max_sessions_per_client: int | None = None,
                   max_sessions_per_address: int | None = None) -> Pool:
    """The pool over one Verifier in this process, its only replica, batched by its own model thread
    as a Ray replica's is. Session limits left None: as many as the verifier holds."""
    most = verifier.limits.max_sessions
    return Pool([verifier], max_sessions_per_client or most, max_sessions_per_address or most, replica_wait_s=0.0)
