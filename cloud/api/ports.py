"""Whether a port can be listened on, and the one-line error when it cannot: the checks `cloud serve`
makes before anything slow starts (cli/cloud_cmd.py) and the binds of the gRPC and metrics servers.

Light on purpose (no grpc, torch or ray): the CLI imports it before the slow imports."""
from __future__ import annotations

import errno
import socket

from ...common.protocol.errors import HybridSpecError


class PortUnavailable(HybridSpecError):
    """A port to listen on is taken (or not a local address): the message names port, host and role."""

    code = "UNAVAILABLE"


def check_port(host: str, port: int, what: str) -> None:
    """Fail fast, before anything slow starts, if host:port is already in use (0 = any port: never).

    Only a probe: other bind errors are left to the real bind (which gives the same messages), and
    the real bind can still lose a race to another process."""
    if port != 0:
        error = probe_port(host, port)
        if error is not None and error.errno == errno.EADDRINUSE:
            raise port_unavailable(host, port, what, error)


def probe_port(host: str, port: int) -> OSError | None:
    """The error binding host:port gives now, the way gRPC and the metrics server bind (SO_REUSEADDR)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in infos:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
    except OSError as exc:
        return exc
    return None


def port_unavailable(host: str, port: int, what: str, error: OSError | None) -> PortUnavailable:
    """The one-line error for a port that could not be bound, `error` being what binding it gave."""
    if error is not None and error.errno == errno.EADDRINUSE:
        return PortUnavailable(f"port {port} on {host} is already in use ({what})")
    reason = (error.strerror or str(error)) if error is not None else "in use or not a local address"
    return PortUnavailable(f"cannot listen on port {port} on {host} ({what}): {reason}")
