"""A verifier replica as a Ray actor: one target model on its device, its sessions, its scheduler.

The actor speaks the wire dataclasses (Ray pickles them); it never sees protobuf. Domain errors are
returned as values rather than raised, so the pool gets the error itself instead of Ray's wrapped
traceback, and a raised exception always means the replica itself failed.

With a `verify_host`, the actor also hosts its own small gRPC endpoint (cloud/api/server.py,
`start_verify_endpoint`) on its event loop, beside the Ray calls: edges stream their rounds to it
directly, saving the front door's hop and the Ray call per round. Protobuf stays in service.py.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from ...common.protocol.errors import HybridSpecError
from ...common.protocol.wire import DraftBlock, ModelInfo, SessionOpened, SessionSpec, VerifyResult
from .backend import ReplicaEndpointBackend
from ..core.telemetry import Tally
from ..core.scheduler import Scheduler
from ..api.server import VerifyEndpoint, start_verify_endpoint
from ..core.verifier import Verifier, VerifierStats
from ..specs import ReplicaSpec

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")  # bound on every interface: advertise the node's address

T = TypeVar("T")


@dataclass(frozen=True)
class ReplicaReady:
    """A loaded replica: what it serves, and where it takes its sessions' rounds directly."""

    info: ModelInfo
    verify_address: str  # HOST:PORT; "" without a direct endpoint


class VerifierReplica:
    """Ray actor class (the pool applies ray.remote with its resources)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        from ..engine.factory import load_engine

        target, engine = load_engine(spec.target, spec.engine, spec.device, spec.dtype, spec.torch_threads, spec.limits)
        verifier = Verifier(target, spec.limits, engine)
        verifier.measure_pass_costs(spec.pass_cost_tokens)
        self.scheduler = Scheduler(verifier, spec.max_batch, spec.max_wait_ms, spec.prefill_budget_ms)
        self._verify_host = spec.verify_host
        self._access = spec.access
        self._endpoint: VerifyEndpoint | None = None
        self._starting = asyncio.Lock()  # concurrent first calls of ready() start one endpoint

    async def ready(self) -> ReplicaReady:
        """Answers once the model is loaded (the constructor has run). The first call starts the
        direct endpoint: it needs the actor's event loop, which the constructor does not run on."""
        async with self._starting:
            if self._verify_host and self._endpoint is None:
                self._endpoint = await start_verify_endpoint(ReplicaEndpointBackend(self.scheduler), self._verify_host,
                                                             _advertised(self._verify_host), self._access)
        return ReplicaReady(self.scheduler.verifier.info, self._endpoint.address if self._endpoint else "")

    async def take_tally(self) -> Tally:
        """The rounds and errors of the direct endpoint since the last call (for the front door's metrics)."""
        return self._endpoint.tally.take() if self._endpoint else Tally()

    async def open_session(self, spec: SessionSpec) -> SessionOpened | HybridSpecError:
        """Open or re-open a session."""
        return await _as_value(self.scheduler.open_session(spec))

    async def verify(self, block: DraftBlock) -> VerifyResult | HybridSpecError:
        """Verify one round in the next batch."""
        return await _as_value(self.scheduler.verify(block))

    async def decode(self, block: DraftBlock, max_tokens: int, eos: frozenset[int]) -> AsyncIterator[int | HybridSpecError]:
        """Cloud-only decoding, streamed (the pool calls it with num_returns="streaming"); a domain
        error is the last item."""
        try:
            async for token in self.scheduler.decode(block, max_tokens, eos):
                yield token
        except HybridSpecError as exc:
            yield exc

    async def close_session(self, session_id: str) -> bool | HybridSpecError:
        """Free a session."""
        return await _as_value(self.scheduler.close_session(session_id))

    async def stats(self) -> VerifierStats | HybridSpecError:
        """Sessions, cached tokens, evictions and the ids held."""
        return await _as_value(self.scheduler.stats())


def _advertised(host: str) -> str:
    """The address edges dial for an endpoint bound on `host`."""
    if host not in WILDCARD_HOSTS:
        return host
    import ray

    ip = ray.util.get_node_ip_address()
    return f"[{ip}]" if ":" in ip else ip


async def _as_value(call: Awaitable[T]) -> T | HybridSpecError:
    """The call's result, or the domain error it raised (the scheduler raises no other kind)."""
    try:
        return await call
    except HybridSpecError as exc:
        return exc
