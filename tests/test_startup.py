"""Start-up that cannot lie: a taken port is one line and a non-zero exit before any model loads, never a
shared port; the metrics server answers /metrics and /health only. Real processes and sockets throughout."""
import asyncio
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from hybridspec.cloud.pool.pool import inprocess_pool
from hybridspec.cloud.api.ports import PortUnavailable
from hybridspec.cloud.api.server import BackgroundServer, start_server

from conftest import UNLOADABLE
from test_cli import ENV


@pytest.fixture
def busy_port():
    """A port some other process-like owner is listening on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def serve(*args):
    """`cloud serve` of a target it cannot load, with these flags, run to its exit."""
    return subprocess.run([sys.executable, "-m", "hybridspec.cli.main", "cloud", "serve", "--target", UNLOADABLE,
                           "--backend", "inprocess", "--torch-threads", "1", *args],
                          capture_output=True, text=True, timeout=60, env=ENV)


@pytest.mark.parametrize("flags, what", [
    (["--port", "{port}", "--metrics-port", "-1"], "gRPC front door"),
    (["--port", "0", "--metrics-port", "{port}"], "metrics HTTP server"),
])
def test_busy_port_is_one_line_before_the_model_loads(busy_port, flags, what):
    result = serve(*(f.format(port=busy_port) for f in flags))
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"hybridspec: error: port {busy_port} on 127.0.0.1 is already in use ({what})"], result.stderr


def test_busy_port_from_config_file(busy_port, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(f"port: 0\nmetrics_port: {busy_port}\n")
    result = serve("--config", str(config))
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"hybridspec: error: port {busy_port} on 127.0.0.1 is already in use (metrics HTTP server)"], result.stderr


def test_the_real_binds_fail_cleanly_and_a_grpc_port_is_never_shared(verifier, busy_port):
    """The CLI's probe aside, start_server itself refuses a taken port: a plain socket's, another
    front door's (gRPC would share it under SO_REUSEPORT), or a taken metrics port."""
    first = BackgroundServer(verifier)
    try:
        for port, metrics_port, what in [(busy_port, None, "gRPC front door"),
                                         (first.running.port, None, "gRPC front door"),
                                         (0, busy_port, "metrics HTTP server")]:
            backend = inprocess_pool(verifier)
            with pytest.raises(PortUnavailable, match=f"port {port or metrics_port} on 127.0.0.1 is already "
                                                      f"in use \\({what}\\)"):
                asyncio.run(start_server(backend, "127.0.0.1", port, metrics_port))
    finally:
        first.stop()


def test_metrics_server_answers_metrics_and_health_only(verifier):
    """/metrics, /health (liveness) and /health/ready (readiness: the front door is SERVING); 404 else."""
    server = BackgroundServer(verifier, metrics_port=0)
    base = f"http://127.0.0.1:{server.running.metrics_port}"
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as reply:
            assert reply.status == 200
            text = reply.read().decode()
        assert "hybridspec_spec_decode_num_drafts_total" in text and "hybridspec_replicas_alive" in text
        assert "_created" not in text
        with urllib.request.urlopen(f"{base}/health", timeout=10) as reply:
            assert reply.status == 200 and len(reply.read()) < 16
        with urllib.request.urlopen(f"{base}/health/ready", timeout=10) as reply:
            assert reply.status == 200
        server.running.metrics.serving.clear()  # what a drain does before the port closes
        with pytest.raises(urllib.error.HTTPError) as not_ready:
            urllib.request.urlopen(f"{base}/health/ready", timeout=10)
        assert not_ready.value.code == 503
        for path in ("/", "/other", "/metrics/x"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"{base}{path}", timeout=10)
            assert refused.value.code == 404
    finally:
        server.stop()
    with pytest.raises(urllib.error.URLError):  # drained: the metrics port is released too
        urllib.request.urlopen(f"{base}/health", timeout=5)
