"""`hybridspec cloud serve` as a process: the port checks its start makes, and starting it as a child
process (for the demo and experiments, which need the cloud on its own core(s), apart from the edge).

Light on purpose (no grpc, torch or ray): the CLI checks its ports with it before the slow imports."""
from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from ..common.protocol.errors import HybridSpecError, Unavailable

READY_PREFIX = "hybridspec verifier serving on "


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


def parse_ready_line(line: str) -> str | None:
    """HOST:PORT from the 'serving on' line, or None for any other line."""
    if not line.startswith(READY_PREFIX):
        return None
    return line[len(READY_PREFIX):].split()[0]


def start_cloud_process(overrides: dict, cores: set[int] | None = None) -> tuple[subprocess.Popen, str, Path]:
    """Start `cloud serve` with these ServeConfig keys (on a free port unless one is given), pinned to
    `cores` (everything it spawns, Ray included, inherits that); wait until it is SERVING.

    Returns the process, its HOST:PORT and the file its log goes to.
    """
    config = {"port": 0, "metrics_port": -1, **overrides}
    config_file = tempfile.NamedTemporaryFile("w", prefix="hybridspec-cloud-", suffix=".yaml", delete=False)
    yaml.safe_dump(config, config_file)
    config_file.close()
    log = tempfile.NamedTemporaryFile("w", prefix="hybridspec-cloud-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "hybridspec.cli.main", "cloud", "serve", "--config", config_file.name]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
    assert proc.stdout is not None
    for line in proc.stdout:
        address = parse_ready_line(line)
        if address is not None:
            return proc, address, Path(log.name)
    proc.wait()
    tail = Path(log.name).read_text().strip().splitlines()[-1:] or ["(no output)"]
    raise Unavailable(f"the cloud exited with status {proc.returncode} before serving: {tail[0]} (log: {log.name})")


def stop_cloud_process(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM (drain), then wait; kill if it does not stop."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
