"""The gRPC front door: Verifier service, standard health checking, reflection, graceful drain."""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..common.proto import verifier_pb2 as pb
from ..common.proto import verifier_pb2_grpc as pb_grpc
from .service import VerifierService
from .verifier import Verifier

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Verifier"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a full-vocabulary q for a long block still fits
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Edges hold long-lived streams across idle stretches; keepalive pings detect dead peers.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


@dataclass
class RunningServer:
    """A started server with the port it bound and its health servicer."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer

    async def drain(self, grace_s: float) -> None:
        """Report NOT_SERVING, let in-flight calls finish for up to grace_s, then stop."""
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)


async def start_server(core: Verifier, host: str, port: int) -> RunningServer:
    """Bind and start; health reports SERVING because the model is already loaded."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_VerifierServicer_to_server(VerifierService(core), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port} (in use or not a local address)")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server=server, port=bound, health=health_servicer)


async def serve_forever(core: Verifier, host: str, port: int, grace_s: float,
                        on_ready: Callable[[int], None] | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then drain and return."""
    running = await start_server(core, host, port)
    if on_ready is not None:
        on_ready(running.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining for up to %.1f s", grace_s)
    await running.drain(grace_s)


class BackgroundServer:
    """A real gRPC server on its own event loop thread, for tests and in-process experiments."""

    def __init__(self, core: Verifier, host: str = "127.0.0.1", port: int = 0) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="grpc-server")
        self._thread.start()
        self._running = asyncio.run_coroutine_threadsafe(start_server(core, host, port), self._loop).result()
        self.address = f"{host}:{self._running.port}"

    def stop(self, grace_s: float = 0.5) -> None:
        """Drain, stop the loop and join its thread."""
        asyncio.run_coroutine_threadsafe(self._running.drain(grace_s), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
