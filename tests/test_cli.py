"""The console script: real subprocesses, one-line errors, JSON output, graceful shutdown."""
import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

ENV = {**os.environ, "HYBRIDSPEC_HOME": "/nonexistent-hybridspec-home"}


def hybridspec(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "hybridspec.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def assert_one_line_error(result, fragment):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("hybridspec: error:") and fragment in lines[0], lines[0]


def test_unreachable_cloud(model_dirs):
    r = hybridspec("edge", "generate", "--cloud", "127.0.0.1:1", "--prompt", "w5 w6", "--drafter",
                   str(model_dirs["target"]))
    assert_one_line_error(r, "unreachable")


def test_missing_default_model_says_how_to_get_it():
    r = hybridspec("edge", "generate", "--prompt", "hi")
    assert_one_line_error(r, "hybridspec models pull")


@pytest.mark.slow
def test_missing_model_path():
    r = hybridspec("cloud", "serve", "--target", "/no/such/model")
    assert_one_line_error(r, "/no/such/model")


def test_bad_config_key(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("port: 1\nmax_sesions: 3\n")
    r = hybridspec("cloud", "serve", "--config", str(cfg))
    assert_one_line_error(r, "max_sesions")


def test_bad_flag_value(model_dirs):
    r = hybridspec("edge", "generate", "--prompt", "x", "--temperature", "-1", "--drafter", str(model_dirs["target"]))
    assert_one_line_error(r, "temperature")


@contextlib.contextmanager
def cloud_serve(model_dirs, *flags: str):
    """`hybridspec cloud serve` (in-process, the tiny target) as a real subprocess on a free port."""
    from hybridspec.cloud.process import parse_ready_line

    proc = subprocess.Popen([sys.executable, "-m", "hybridspec.cli.main", "cloud", "serve", "--target",
                             str(model_dirs["target"]), "--port", "0", "--metrics-port", "-1", "--torch-threads", "1",
                             "--backend", "inprocess", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        line = proc.stdout.readline()
        address = parse_ready_line(line)
        assert address, proc.stderr.read() if proc.poll() is not None else line
        yield proc, address
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def served(model_dirs):
    with cloud_serve(model_dirs) as running:
        yield running


@pytest.mark.slow
def test_generate_json(served, model_dirs, target):
    from tinymodels import greedy_reference

    _, address = served
    r = hybridspec("edge", "generate", "--cloud", address, "--prompt", "w5 w17 w33", "--drafter",
                   str(model_dirs["random"]), "--max-new-tokens", "12", "--max-draft", "3", "--json",
                   "--gamma-policy", "fixed", "--no-cloud-only-switch")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == greedy_reference(target, [5, 17, 33], 12)
    assert out["text"] == target.tokenizer.decode(out["token_ids"], skip_special_tokens=True)
    for key in ("rounds", "drafted", "accepted", "acceptance_rate", "mean_tokens_per_round", "fallbacks",
                "uplink_bytes", "downlink_bytes", "wall_s", "tokens_per_s"):
        assert key in out["stats"]
    assert out["stats"]["rounds"] >= 4


@pytest.mark.slow
def test_generate_cloud_only_baseline(served, model_dirs, target):
    from tinymodels import greedy_reference

    _, address = served
    r = hybridspec("edge", "generate", "--cloud", address, "--prompt", "w5 w17 w33", "--drafter",
                   str(model_dirs["random"]), "--max-new-tokens", "12", "--cloud-only")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == target.tokenizer.decode(greedy_reference(target, [5, 17, 33], 12),
                                                       skip_special_tokens=True)
    assert "decoded by the cloud alone" in r.stderr and "acceptance" not in r.stderr


@pytest.mark.slow
def test_a_session_refused_before_any_token_is_one_error_line_and_no_text(model_dirs):
    """A cloud that refuses the session (here: full) before a token is committed. It used to print an
    empty line, a "[0 tokens, ...]" summary and an error saying "the text above is what was verified",
    with no text above; and --json said finish_reason "length"."""
    from hybridspec.common.protocol.wire import SessionSpec
    from hybridspec.edge.client import VerifierClient

    with cloud_serve(model_dirs, "--max-sessions", "1") as (_, address), VerifierClient(address) as holder:
        holder.open_session(SessionSpec("", (5, 6, 7)))  # the replica's only session
        args = ("edge", "generate", "--cloud", address, "--prompt", "w5 w17 w33", "--drafter",
                str(model_dirs["random"]), "--max-new-tokens", "4")
        for mode in ((), ("--stream",)):
            r = hybridspec(*args, *mode)
            assert_one_line_error(r, "limit")
            assert "text above" not in r.stderr and r.stdout == "", (mode, r.stdout)
        r = hybridspec(*args, "--json")
        assert_one_line_error(r, "limit")
        out = json.loads(r.stdout)
        assert (out["token_ids"], out["finish_reason"]) == ([], "error") and "limit" in out["error"]


@pytest.mark.slow
def test_mismatched_tokenizer_is_refused(served, model_dirs):
    _, address = served
    r = hybridspec("edge", "generate", "--cloud", address, "--prompt", "v5", "--drafter", str(model_dirs["alien"]))
    assert_one_line_error(r, "tokenizer")


@pytest.mark.slow
def test_sigterm_drains_and_exits_zero(served):
    proc, _ = served
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


@pytest.mark.slow
def test_cloud_serve_with_a_ray_pool_serves_metrics_and_drains(model_dirs, tmp_path):
    """The default backend: a real local Ray cluster with one replica, started and stopped by the CLI."""
    import re
    import urllib.request

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from hybridspec.cloud.process import parse_ready_line

    proc = subprocess.Popen([sys.executable, "-m", "hybridspec.cli.main", "cloud", "serve", "--target",
                             str(model_dirs["target"]), "--port", "0", "--metrics-port", "0", "--replicas", "1",
                             "--torch-threads", "1"],
                            stdout=subprocess.PIPE, stderr=(tmp_path / "stderr").open("w"), text=True, env=ENV)
    try:
        line = proc.stdout.readline()
        address = parse_ready_line(line)
        if not address:  # it exited: say why
            proc.kill()
            pytest.fail(f"cloud serve printed {line!r}; stderr: {(tmp_path / 'stderr').read_text()[-2000:]}")
        assert "1 Ray replica" in line, line
        with grpc.insecure_channel(address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        metrics_port = re.search(r"metrics on [\d.]+:(\d+)", line).group(1)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert "hybridspec_replicas_alive" in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_cloud_serve_ray_listens_on_loopback_and_leaves_no_process_behind(model_dirs):
    """Regression: Ray's ports listened on every interface, and a killed front door left two Ray
    agents running (holding their ports for about a minute)."""
    import time

    import psutil

    from hybridspec.cloud.process import parse_ready_line

    proc = subprocess.Popen([sys.executable, "-m", "hybridspec.cli.main", "cloud", "serve", "--target",
                             str(model_dirs["target"]), "--port", "0", "--metrics-port", "-1", "--replicas", "1",
                             "--torch-threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
    try:
        assert parse_ready_line(proc.stdout.readline())
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        assert any("raylet" in " ".join(p.cmdline()) for p in tree)  # the tree really holds Ray
        listening = [(p.pid, c.laddr.ip) for p in tree for c in p.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert listening and all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for _, ip in listening), listening
        proc.kill()  # SIGKILL: no handler of ours runs
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while (left := [p for p in tree[1:] if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]):
            assert time.monotonic() < deadline, [" ".join(p.cmdline())[:80] for p in left]
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_serve_with_the_verifier_in_a_process_of_its_own(model_dirs, target):
    """`cloud serve --backend process`: the edge gets the target's greedy text; SIGTERM stops the front door
    and its verifier process with it."""
    import psutil
    from tinymodels import greedy_reference

    with cloud_serve(model_dirs, "--backend", "process") as (proc, address):
        children = [child for child in psutil.Process(proc.pid).children()
                    if "spawn_main" in " ".join(child.cmdline())]  # not multiprocessing's resource tracker
        assert len(children) == 1, "the verifier should run in one child process"
        r = hybridspec("edge", "generate", "--cloud", address, "--prompt", "w5 w17 w33", "--drafter",
                       str(model_dirs["random"]), "--max-new-tokens", "12", "--max-draft", "3", "--json",
                       "--gamma-policy", "fixed", "--no-cloud-only-switch")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["token_ids"] == greedy_reference(target, [5, 17, 33], 12)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
        psutil.wait_procs(children, timeout=30)
        assert not any(child.is_running() and child.status() != psutil.STATUS_ZOMBIE for child in children)
