"""A verifier replica as a Ray actor: one target model on its device, its sessions, its model thread.

The actor speaks the wire dataclasses (Ray pickles them); it never sees protobuf. Domain errors are
returned as values rather than raised, so the pool gets the error itself instead of Ray's wrapped
traceback, and a raised exception always means the replica itself failed.

Given an endpoint to start (the gRPC layer's `ReplicaEndpoint`, cloud/api/server.py, handed down
through the pool so that the pool never imports the layer above it), the actor also hosts its own
small gRPC endpoint on its event loop, beside the Ray calls: edges stream their rounds to it
directly, saving the front door's hop and the Ray call per round. Protobuf stays in cloud/api/.
Such a replica charges every call that does work on it to its endpoint's rate buckets, the opens
and the rounds that come through the front door too (which then charges nothing), so an identity's
rate on one replica is its rate, not one bucket at the front door plus one at the endpoint.

By default (`PoolSettings.model_process`) the model runs in a process of its own that the actor starts
(cloud/pool/process_replica.py): the endpoint's gRPC and Ray's calls then never take turns with the model
loop for one interpreter, which at 64 edges cost the loop most of its host time per step
(docs/measurements.md). When that process dies, so does the actor, and Ray restarts both.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol, TypeVar

from ...common.protocol.errors import HybridSpecError
from ...common.protocol.wire import DraftBlock, ModelInfo, OpenProgress, SessionOpened, SessionSpec, VerifyResult
from ..core.heap import settle_heap
from ..core.telemetry import ClockSwitch, StepClock, Tally
from .loading import load_verifier
from .process_replica import ProcessReplica
from .specs import ReplicaSpec

if TYPE_CHECKING:  # imported where a model is loaded: the front door of a Ray pool never imports torch
    from ..core.verifier import Verifier, VerifierStats

log = logging.getLogger(__name__)

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")  # bound on every interface: advertise the node's address

T = TypeVar("T")


class Endpoint(Protocol):
    """A replica's own gRPC endpoint, once started."""

    address: str  # HOST:PORT as clients should dial it

    def take_tally(self) -> Tally:
        """Its rounds and errors since the last call."""

    def pace(self, owner: str, tokens: int) -> float:
        """Seconds work of `tokens` tokens for the identity `owner` must wait by its rate, charged to the
        bucket the endpoint's own calls use; ResourceExhausted if too long."""


class EndpointStarter(Protocol):
    """Starts a replica's own endpoint for its sessions' rounds (picklable: Ray ships it to the actor)."""

    host: str  # the interface to bind

    async def start(self, verifier: Verifier | ProcessReplica, advertised_host: str) -> Endpoint:
        """Serve `verifier`'s sessions' rounds on a free port of `host`; clients dial `advertised_host`."""


@dataclass(frozen=True)
class ReplicaReady:
    """A loaded replica: what it serves, and where it takes its sessions' rounds directly."""

    info: ModelInfo
    verify_address: str  # HOST:PORT; "" without a direct endpoint


class VerifierReplica:
    """Ray actor class (the pool applies ray.remote with its resources)."""

    def __init__(self, spec: ReplicaSpec, endpoint: EndpointStarter | None, model_process: bool) -> None:
        """Load the target here, or (`model_process`, PoolSettings') have `ready` start a process of its own
        that loads it; `endpoint`: the replica's own endpoint, started by `ready` (None: rounds come through
        the front door only)."""
        self._measured: Future[ModelInfo] = Future()  # set once the curve is in
        self.verifier: Verifier | ProcessReplica = ProcessReplica(
            "ray-replica", functools.partial(load_verifier, spec), measured=self._curve_in, lost=_exit_for_ray) \
            if model_process else load_verifier(spec, self._curve_in)
        self._starter = endpoint
        self._endpoint: Endpoint | None = None
        self._starting = asyncio.Lock()  # concurrent first calls of ready() start one model thread and endpoint
        self._started = False
        self._clock = ClockSwitch()

    async def ready(self) -> ReplicaReady | HybridSpecError:
        """Answers once the model is loaded: the constructor has run, and the model's own process (if it has
        one) has loaded it, else the one-line error why not. The first call starts the verifier's model
        thread (or process) and the direct endpoint (which need the actor's event loop, which the
        constructor does not run on)."""
        async with self._starting:
            if not self._started:
                try:
                    await self.verifier.start()
                except HybridSpecError as exc:  # the model's process could not load it
                    return exc
                self._started = True
                settle_heap()
            if self._starter is not None and self._endpoint is None:
                self._endpoint = await self._starter.start(self.verifier, _advertised(self._starter.host))
        return ReplicaReady(self.verifier.model_info(), self._endpoint.address if self._endpoint else "")

    async def measured_info(self) -> ModelInfo:
        """What it serves once its pass-cost curve is in `info` (waits while it is measured)."""
        return await asyncio.wrap_future(self._measured)

    async def take_tally(self) -> Tally:
        """The rounds and errors of the direct endpoint since the last call (for the front door's metrics)."""
        return self._endpoint.take_tally() if self._endpoint else Tally()

    async def open_session_progress(self, spec: SessionSpec) -> AsyncIterator[OpenProgress | SessionOpened
                                                                               | HybridSpecError]:
        """Open or re-open a session, streamed (the pool calls it with num_returns="streaming"): how far
        it has got every second, then its answer, which names this replica's endpoint (a restart moves
        it); a domain error is the last item. Its prompt is charged to the caller's rate first."""
        try:
            address = await self._serving()
            await self._pace(spec.owner, len(spec.committed_ids))
            async for item in self.verifier.aopen_progress(spec):
                yield replace(item, verify_address=address) if isinstance(item, SessionOpened) else item
        except HybridSpecError as exc:
            yield exc

    async def verify(self, block: DraftBlock) -> VerifyResult | HybridSpecError:
        """Verify one round in the next batch (charged to its sender's rate first)."""
        try:
            await self._serving()
            await self._pace(block.owner, len(block.draft_ids) + 1)
        except HybridSpecError as exc:
            return exc
        return await _as_value(self.verifier.averify(block))

    async def decode(self, block: DraftBlock, max_tokens: int, eos: frozenset[int]) -> AsyncIterator[int | HybridSpecError]:
        """Cloud-only decoding, streamed (the pool calls it with num_returns="streaming"), each token
        charged to the caller's rate; a domain error is the last item."""
        try:
            await self._serving()
            async for token in self.verifier.adecode(block, max_tokens, eos):
                await self._pace(block.owner, 1)
                yield token
        except HybridSpecError as exc:
            yield exc

    async def close_session(self, session_id: str) -> bool | HybridSpecError:
        """Free a session."""
        return await _as_value(self._served(self.verifier.aclose_session, session_id))

    async def stats(self) -> VerifierStats | HybridSpecError:
        """Sessions, cached tokens, evictions and the ids held."""
        return await _as_value(self._served(self.verifier.astats))

    async def step_clock(self, on: bool) -> tuple[StepClock, float] | None:
        """Start timing the model thread's steps part by part (on), or stop and return the clock and the CPU
        seconds of the model's process meanwhile (bench/hop_overhead.py --host)."""
        if isinstance(self.verifier, ProcessReplica):
            return await self.verifier.step_clock(on)
        return self._clock.turn(self.verifier, on)

    async def _serving(self) -> str:
        """Its endpoint's address ("" without one), after starting what `ready` starts if nobody has:
        Ray restarts a dead actor without anyone calling `ready` unless the pool saw it die, so every
        call comes through here. Once started, no lock is taken. Raises why the model is not loaded."""
        if not self._started or (self._starter is not None and self._endpoint is None):
            ready = await self.ready()
            if isinstance(ready, HybridSpecError):
                raise ready
        return self._endpoint.address if self._endpoint else ""

    async def _served(self, call: Callable[..., Awaitable[T]], *args) -> T:
        await self._serving()
        return await call(*args)

    def _curve_in(self, info: ModelInfo) -> None:
        if not self._measured.done():
            self._measured.set_result(info)

    async def _pace(self, owner: str, tokens: int) -> None:
        """Wait as the caller's rate says (its endpoint's bucket; nothing without an endpoint: then the
        front door paces); ResourceExhausted if it would wait too long."""
        delay = self._endpoint.pace(owner, tokens) if self._endpoint is not None else 0.0
        if delay > 0:
            await asyncio.sleep(delay)


def _advertised(host: str) -> str:
    """The address edges dial for an endpoint bound on `host`."""
    if host not in WILDCARD_HOSTS:
        return host
    import ray

    ip = ray.util.get_node_ip_address()
    return f"[{ip}]" if ":" in ip else ip


def _exit_for_ray() -> None:
    """The model's process died (its sessions with it): the actor exits too, so that Ray restarts the
    replica and the pool sees it down meanwhile, as when the actor itself dies."""
    log.error("the replica's model process exited; exiting so that Ray restarts the replica")
    os._exit(1)


async def _as_value(call: Awaitable[T]) -> T | HybridSpecError:
    """The call's result, or the domain error it raised (the verifier raises no other kind)."""
    try:
        return await call
    except HybridSpecError as exc:
        return exc
