"""The gRPC front door: Verifier service, health checking, reflection, metrics, graceful drain; and
the small direct endpoint each Ray replica serves its own sessions' rounds on.

The port is bound before the models load, so health checks answer NOT_SERVING while replicas
start; the server reports SERVING once the backend is ready and NOT_SERVING again when draining.
A port that is taken (gRPC or metrics) fails the start before the backend starts, with one line
naming it: the gRPC port is bound without SO_REUSEPORT, so a second server can never share it.
Both kinds of endpoint speak TLS when the AccessSpec has a certificate, and take Verifier calls only
from the identities in its credentials file when it names one (cloud/api/access.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ...common.protocol.channel import DEFAULT_HOST, SHARED_OPTIONS
from ...common.security.tls import ServerTLS
from .access import Access, AccessSpec
from .admission import Admission
from ..pool.pool import Pool, inprocess_pool
from .metrics import EndpointTally, Metrics, MetricsHTTPServer
from .ports import port_unavailable, probe_port
from .service import SERVICE_NAME, Decoder, VerifierService
from ..core.heap import settle_heap
from ..core.telemetry import Tally

if TYPE_CHECKING:  # a Ray pool's front door serves no model: it never imports torch
    from ..core.verifier import Verifier

log = logging.getLogger(__name__)

# Calls in flight at once (a stream counts for its lifetime); beyond it gRPC answers RESOURCE_EXHAUSTED,
# which bounds the memory that request bodies and waiting calls can take. Calls are admitted per caller
# well below it (cloud/api/admission.py), and refused ones end at once, so no one caller can reach it.
MAX_CONCURRENT_RPCS = 1024
SERVER_OPTIONS = [
    *SHARED_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # gRPC sets SO_REUSEPORT by default on Linux: a second server on a taken port would then bind it
    # too and silently share its connections. Off, the second bind fails (PortUnavailable).
    ("grpc.so_reuseport", 0),
]
STATUS_REFRESH_S = 2.0  # how often replica gauges (sessions, evictions, liveness) are refreshed


def _grpc_server(gate: Access, metrics: Metrics | EndpointTally) -> grpc.aio.Server:
    """A gRPC server whose Verifier calls are admitted at call start (cloud/api/admission.py)."""
    return grpc.aio.server(options=SERVER_OPTIONS, maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
                           interceptors=[Admission(gate, metrics)])


def _bind_grpc(server: grpc.aio.Server, host: str, port: int, what: str, tls: ServerTLS) -> int:
    """add_secure_port (TLS) or add_insecure_port; a failed bind (0, or RuntimeError in recent grpcio)
    becomes PortUnavailable."""
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, tls.grpc_credentials()) if tls.enabled
                 else server.add_insecure_port(address))
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise port_unavailable(host, port, what, probe_port(host, port) if port else None)
    return bound


@dataclass
class RunningServer:
    """A started front door: its port, health servicer, metrics and backend."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    backend: Pool
    metrics: Metrics
    metrics_http: MetricsHTTPServer | None
    refresher: asyncio.Task

    @property
    def metrics_port(self) -> int | None:
        """The bound /metrics port, or None when there is no metrics endpoint."""
        return self.metrics_http.port if self.metrics_http is not None else None

    async def drain(self, grace_s: float) -> None:
        """Report NOT_SERVING, let in-flight calls finish for up to grace_s, then stop the backend."""
        self.metrics.serving.clear()
        await _set_health(self.health, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)
        self.refresher.cancel()
        await self.backend.stop()
        if self.metrics_http is not None:
            self.metrics_http.close()

    async def refresh_metrics(self) -> None:
        """Pull replica state into the gauges now (also done every STATUS_REFRESH_S)."""
        self.metrics.observe_replicas(await self.backend.status())


async def start_server(backend: Pool, host: str, port: int, metrics_port: int | None = None,
                       metrics_host: str = DEFAULT_HOST, access: AccessSpec = AccessSpec()) -> RunningServer:
    """Bind both ports, start the backend, then report SERVING. metrics_port None: no /metrics endpoint.
    PortUnavailable, before the backend starts, if either port cannot be bound; ConfigError if a TLS
    or credentials file cannot be used."""
    gate = Access(access)
    access.tls.check_files()
    metrics = Metrics()
    server = _grpc_server(gate, metrics)
    VerifierService(backend, metrics, gate).register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    bound = _bind_grpc(server, host, port, "gRPC front door", access.tls)
    metrics_http = None
    if metrics_port is not None:
        try:
            metrics_http = metrics.serve_http(metrics_host, metrics_port)
        except OSError as exc:
            await server.stop(0)
            raise port_unavailable(metrics_host, metrics_port, "metrics HTTP server", exc) from None
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    try:
        await backend.start()
    except BaseException:
        await server.stop(0)
        if metrics_http is not None:
            metrics_http.close()
        raise
    running = RunningServer(server, bound, health_servicer, backend, metrics, metrics_http,
                            asyncio.get_running_loop().create_task(_refresh_forever(backend, metrics)))
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    metrics.serving.set()
    return running


@dataclass
class VerifyEndpoint:
    """A replica's own endpoint: VerifyStream and Decode for the sessions that replica holds, and health."""

    server: grpc.aio.Server
    address: str  # HOST:PORT as clients should dial it
    tally: EndpointTally  # its rounds and errors, until the front door collects them
    gate: Access  # its callers' identities, call counts and rates

    def take_tally(self) -> Tally:
        """Its rounds and errors since the last call (the replica hands them to the front door's metrics)."""
        return self.tally.take()

    def pace(self, owner: str, tokens: int) -> float:
        """Seconds work of `tokens` target tokens for the identity `owner` must wait, charged to the same
        rate bucket as this endpoint's own calls (ResourceExhausted if too long): how the replica charges
        the opens and the rounds that reach it through the front door."""
        return self.gate.pace_named(owner, tokens)


@dataclass(frozen=True)
class ReplicaEndpoint:
    """The endpoint each Ray replica starts for its own sessions' rounds (cloud/pool/replica.py takes it as
    an `EndpointStarter`): bound on `host`, with the front door's access rules."""

    host: str  # the front door's interface
    access: AccessSpec = AccessSpec()  # TLS and credentials (the files are read on the replica's node)

    async def start(self, verifier: Decoder, advertised_host: str) -> VerifyEndpoint:
        """Serve `verifier`'s sessions' rounds on a free port of `host` (a replica's verifier, or the process
        running it); clients dial `advertised_host`."""
        return await start_verify_endpoint(verifier, self.host, advertised_host, self.access)


async def start_verify_endpoint(verifier: Decoder, host: str, advertised_host: str,
                                access: AccessSpec = AccessSpec()) -> VerifyEndpoint:
    """Serve `verifier`'s VerifyStream and Decode on a free port of `host` (the front door's interface),
    with the front door's TLS, credentials, rates, limits, validation and error handling (the same
    VerifierService); no other Verifier RPC: sessions are opened, closed and counted against their
    client only at the front door. No routing table either: the verifier is the authority, answering
    FAILED_PRECONDITION for any id it does not hold, whoever presents it, and checking that a session
    is the caller's."""
    tally = EndpointTally()
    gate = Access(access)
    server = _grpc_server(gate, tally)
    VerifierService(verifier, tally, gate).register(server, only=("VerifyStream", "Decode"))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = _bind_grpc(server, host, 0, "a replica's verify endpoint", access.tls)
    await server.start()
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    return VerifyEndpoint(server, f"{advertised_host}:{port}", tally, gate)


async def serve_forever(backend: Pool, host: str, port: int, grace_s: float, metrics_port: int | None = None,
                        metrics_host: str = DEFAULT_HOST, on_ready: Callable[[RunningServer], None] | None = None,
                        access: AccessSpec = AccessSpec()) -> None:
    """Serve until SIGINT or SIGTERM, then drain and return."""
    running = await start_server(backend, host, port, metrics_port, metrics_host, access)
    settle_heap()
    # Installed after the backend started, so they replace any handler Ray installed meanwhile.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if on_ready is not None:
        on_ready(running)
    await stop.wait()
    log.info("draining for up to %.1f s", grace_s)
    await running.drain(grace_s)


async def _set_health(servicer: health.aio.HealthServicer, status) -> None:
    await servicer.set("", status)
    await servicer.set(SERVICE_NAME, status)


async def _refresh_forever(backend: Pool, metrics: Metrics) -> None:
    while True:
        with contextlib.suppress(Exception):  # metrics must never take the server down
            metrics.observe_replicas(await backend.status())
        await asyncio.sleep(STATUS_REFRESH_S)


class BackgroundServer:
    """A real gRPC front door on its own event-loop thread, for tests and in-process experiments."""

    def __init__(self, backend: Pool | Verifier, host: str = DEFAULT_HOST, port: int = 0,
                 metrics_port: int | None = None, access: AccessSpec = AccessSpec()) -> None:
        """A bare Verifier is served in-process with default batching."""
        if not isinstance(backend, Pool):
            backend = inprocess_pool(backend)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="grpc-server")
        self._thread.start()
        try:
            self.running = self.call(start_server(backend, host, port, metrics_port, access=access))
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            raise
        self.backend = backend
        self.address = f"{host}:{self.running.port}"

    def call(self, coro):
        """Run a coroutine on the server's loop and return its result (for tests poking the backend)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def stop(self, grace_s: float = 0.5) -> None:
        """Drain, stop the loop and join its thread."""
        self.call(self.running.drain(grace_s))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
