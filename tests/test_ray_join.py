"""Starting or joining a Ray cluster, as an operator meets it on one machine (issue 43).

A Ray cluster made with Ray's own CLI (`ray start --head`, `ray start --address`), joined by
`cloud serve --ray-address`; a stale cluster file and an inherited RAY_ADDRESS that `cloud serve`
without an address must not follow; unreachable addresses and a cluster with token authentication,
which must fail in bounded time with one line naming the cause. Every cluster here lives in a private
directory (its HOME and RAY_TMPDIR) on free ports, and is ended by this module (tests/raynodes.py).
"""
from __future__ import annotations

import itertools
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import psutil
import pytest

from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.worker import EdgeWorker
from conftest import REPLICA_RESTART_S
from raynodes import CloudServe, Operator, free_port, private_dir
from tinymodels import EVERY_ROUND, greedy_reference

pytestmark = pytest.mark.slow  # Ray clusters of our own, started with Ray's CLI
STARTS_WITHIN_S = 180  # a local cluster and one tiny replica on a loaded 2-core machine take 15-40 s
FAILS_WITHIN_S = 45  # a join that cannot work: connection check + the head check + Python's start
PROMPTS = [[5, 17, 33, 80], [7, 19, 40, 81], [9, 21, 47, 82], [11, 23, 54, 83]]
NEW_TOKENS = 16
# The GCS's answer to a client of the cluster's choosing (run in a child, with the auth settings given).
GCS_PROBE = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).check_alive([], timeout=5)
    print("accepted")
except Exception as exc:
    print("refused" if "InvalidAuthToken" in str(exc) else f"error: {exc}")
"""


def serve_args(model_dirs, *extra: str) -> list[str]:
    """A tiny target, any free port, /metrics on, one thread per replica."""
    return ["--target", str(model_dirs["target"]), "--port", "0", "--metrics-port", "0", "--torch-threads", "1",
            *extra]


def metrics(line: str) -> str:
    """The front door's /metrics text, from its 'serving on' line."""
    port = re.search(r"metrics on [\d.]+:(\d+)", line).group(1)
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def assert_one_line(serve: CloudServe, *fragments: str) -> str:
    """The run failed with exactly one line on stderr, the CLI's error, naming every fragment."""
    lines = serve.stderr().strip().splitlines()
    assert len(lines) == 1, serve.stderr()
    assert lines[0].startswith("hybridspec: error:"), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def generate(address: str, drafter, prompt: list[int], **cfg):
    config = EdgeConfig.of(cloud=address, max_new_tokens=NEW_TOKENS, max_draft=3, **cfg)
    with VerifierClient(address) as client:
        return EdgeWorker(drafter, client, config).generate(prompt)


# ---- a cluster of our own, whatever the machine says -------------------------------------------

@pytest.fixture(scope="module")
def operator():
    """The operator's shell: its own HOME and RAY_TMPDIR. Used first by a plain `cloud serve` (a
    cluster of its own), then for the operator's own cluster: what the first leaves must not break it."""
    op = Operator(private_dir("hs-op-"))
    yield op
    op.stop()


@pytest.fixture(scope="module")
def local_serve(operator, model_dirs):
    """`cloud serve` with no address, while the machine points elsewhere: a ray_current_cluster file
    naming a head that is gone, and RAY_ADDRESS naming it too. What it did, for the tests to check."""
    dead = f"127.0.0.1:{free_port()}"
    (operator.root / "ray").mkdir()
    (operator.root / "ray" / "ray_current_cluster").write_text(dead + "\n")
    serve = CloudServe(operator, *serve_args(model_dirs, "--replicas", "1", "--replica-num-cpus", "0.5"),
                       env={"RAY_ADDRESS": dead})
    try:
        address = serve.wait_serving(STARTS_WITHIN_S)
        record = {"dead": dead, "address": address}
        gcs = next(p for p in serve.tree() if p.name() == "gcs_server")  # its port: a free one Ray picked
        ports = [c.laddr.port for c in gcs.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        for key, auth in (("no_token", {"RAY_AUTH_MODE": "disabled"}),
                          ("wrong_token", {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64})):
            record[key] = [subprocess.run([sys.executable, "-c", GCS_PROBE, f"127.0.0.1:{port}"], capture_output=True,
                                          text=True, timeout=60, env={**operator.env, **auth}).stdout.strip()
                           for port in ports]
        serve.proc.send_signal(signal.SIGTERM)
        record["exit"] = serve.wait_exit(60)
        record["stderr"] = serve.stderr()
        return record
    finally:
        serve.kill()


def test_without_an_address_it_starts_its_own_cluster_whatever_the_machine_says(local_serve):
    """Regression: with a stale /tmp/ray/ray_current_cluster (or RAY_ADDRESS) naming a head that is
    gone, `cloud serve` with the local config tried to join it and waited for minutes without a word."""
    assert local_serve["exit"] == 0, local_serve["stderr"]  # it served (within STARTS_WITHIN_S) and stopped
    assert f"ignoring RAY_ADDRESS={local_serve['dead']}" in local_serve["stderr"]


def test_its_own_cluster_keeps_token_auth_and_leaves_no_token_file(local_serve, operator):
    """Its cluster refuses a client without its token, yet nothing is left in ~/.ray: Ray would have
    written ~/.ray/auth_token, and with that file a plain `ray start --head` turns token auth on while a
    plain `ray start --address` does not (InvalidAuthToken; the operator_cluster fixture tries it)."""
    assert "refused" in local_serve["no_token"], local_serve  # the GCS's port refuses; any other is not Ray's
    assert "refused" in local_serve["wrong_token"], local_serve
    assert "accepted" not in local_serve["no_token"] + local_serve["wrong_token"], local_serve
    assert not (operator.root / ".ray").exists(), list((operator.root / ".ray").iterdir())


# ---- joining the operator's cluster --------------------------------------------------------------

@pytest.fixture(scope="module")
def operator_cluster(operator, local_serve):
    """Two nodes started with Ray's CLI and default settings, one CPU each, in the same HOME the plain
    `cloud serve` above ran in."""
    operator.start_head(num_cpus=1)
    node = operator.add_node(num_cpus=1)
    assert node.returncode == 0, f"the second node did not join: {node.stderr[-1500:]}"
    assert len(operator.raylets()) == 2
    return operator


def replica_pids(operator: Operator) -> dict[int, int]:
    """pid -> node index (0 = head) of every verifier replica's process."""
    found = {}
    for node, raylet in enumerate(operator.raylets()):
        for child in raylet.children(recursive=True):
            try:
                if "VerifierReplica" in child.name() or "VerifierReplica" in " ".join(child.cmdline()):
                    found[child.pid] = node
            except psutil.NoSuchProcess:
                pass
    return found


def listener_pid(address: str) -> int | None:
    """The process listening on a replica endpoint's port."""
    port = int(address.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
            return conn.pid
    return None


def test_join_two_nodes_serve_recover_and_leave_the_cluster_running(operator_cluster, model_dirs, target,
                                                                    random_drafter):
    op = operator_cluster
    serve = CloudServe(op, *serve_args(model_dirs, "--ray-address", op.address, "--replicas", "2",
                                       "--replica-num-cpus", "1"))
    try:
        address = serve.wait_serving(STARTS_WITHIN_S)
        ready_line = next(line for line in serve.lines if address in line)
        assert "2 Ray replica" in ready_line
        pids = replica_pids(op)
        assert sorted(pids.values()) == [0, 1], pids  # one replica on each node
        # 1. Hybrid rounds give exactly what cloud-only decoding gives (and the target's greedy text).
        for prompt in PROMPTS[:2]:
            hybrid = generate(address, random_drafter, prompt, **EVERY_ROUND)
            cloud = generate(address, random_drafter, prompt, cloud_only=True)
            assert hybrid.stats.rounds >= 4 and cloud.stats.rounds == 0
            assert hybrid.token_ids == cloud.token_ids == greedy_reference(target, prompt, NEW_TOKENS)
        # 2. Mid-generation, kill the replica on the second node that holds the session (sessions
        #    alternate between replicas: at most a few tries land one there). The edge re-opens it.
        killed = None
        for prompt in PROMPTS:
            def kill_on_second_node(client, calls: int) -> None:
                nonlocal killed
                pid = listener_pid(client.rounds_address)
                if calls == 3 and killed is None and replica_pids(op).get(pid) == 1:
                    psutil.Process(pid).kill()
                    killed = pid

            gen, _ = generate_watched(address, random_drafter, prompt, kill_on_second_node)
            assert gen.token_ids == greedy_reference(target, prompt, NEW_TOKENS)
            if killed is not None:
                assert gen.stats.reopens >= 1
                break
        assert killed is not None, "no session landed on the second node's replica"
        # 3. Ray restarts it on the node that lost it; once the pool counts it alive again (its view is
        #    refreshed every 2 s), it serves exact rounds again.
        deadline = time.monotonic() + REPLICA_RESTART_S
        while metric(metrics(ready_line), "hybridspec_replicas_alive") < 2 or \
                not (restarted := {pid for pid, node in replica_pids(op).items() if node == 1} - {killed}):
            assert time.monotonic() < deadline, "the killed replica did not come back"
            time.sleep(0.5)
        #    New sessions go to the replica holding fewer; a route the pool kept for the killed session
        #    counts until the pool's refresh drops it (it asks each replica what it holds every 2 s).
        deadline = time.monotonic() + 60
        for prompt in itertools.cycle(PROMPTS):
            gen, served_by = generate_watched(address, random_drafter, prompt)
            assert gen.token_ids == greedy_reference(target, prompt, NEW_TOKENS)
            if served_by in restarted:
                break
            assert time.monotonic() < deadline, f"no session was served by the restarted replica {restarted}"
        # 4. A clean stop: the pool ends its replicas and leaves the operator's cluster running.
        tree = serve.tree()
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.wait_exit(60) == 0, serve.stderr()
        deadline = time.monotonic() + 30
        while (left := [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]) or replica_pids(op):
            assert time.monotonic() < deadline, (left, replica_pids(op))
            time.sleep(0.5)
        assert all(r.is_running() for r in op.raylets()) and len(op.raylets()) == 2
        status = op.ray("status", "--address", op.address, timeout=60)
        assert status.returncode == 0 and len(re.findall(r"^\s*1 node_", status.stdout, re.M)) == 2, status.stdout
    finally:
        serve.kill()


def generate_watched(address: str, drafter, prompt: list[int], before_round=None):
    """An edge generation in hybrid rounds, calling before_round(client, round number) before each
    round is sent; returns it and the pid of the replica that served its last round."""
    config = EdgeConfig.of(cloud=address, max_new_tokens=NEW_TOKENS, max_draft=3, **EVERY_ROUND)
    with VerifierClient(address) as client:
        worker = EdgeWorker(drafter, client, config)
        original, calls = client.submit, [0]

        def submit(block):
            calls[0] += 1
            if before_round is not None:
                before_round(client, calls[0])
            return original(block)

        client.submit = submit  # the real round still goes over gRPC to the replica's endpoint
        gen = worker.generate(prompt)
        return gen, listener_pid(client.rounds_address)


# ---- failures: bounded, one line, the cause named --------------------------------------------

def test_an_unreachable_address_fails_at_once_naming_it(model_dirs):
    op = Operator(private_dir("hs-dead-"))
    try:
        dead = f"127.0.0.1:{free_port()}"
        serve = CloudServe(op, *serve_args(model_dirs, "--ray-address", dead))
        assert serve.wait_exit(FAILS_WITHIN_S) != 0
        assert_one_line(serve, "cannot reach the Ray cluster at", f":{dead.rsplit(':', 1)[1]}", "connection refused")
    finally:
        op.stop()


def test_a_port_that_is_not_a_ray_head_fails_within_the_join_timeout(model_dirs):
    """Ray's own client would try such a port 20 times, about 40 s each."""
    op = Operator(private_dir("hs-mute-"))
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))  # Ray dials 127.0.0.1 as this machine's own address (as a head listens)
    listener.listen(8)
    accepted = []
    threading.Thread(target=lambda: [accepted.append(listener.accept()) for _ in range(8)], daemon=True).start()
    try:
        port = listener.getsockname()[1]
        serve = CloudServe(op, *serve_args(model_dirs, "--ray-address", f"127.0.0.1:{port}", "--ray-join-timeout-s", "3"))
        assert serve.wait_exit(FAILS_WITHIN_S) != 0
        assert_one_line(serve, f":{port}", "no Ray head answered", "within 3 s")
    finally:
        listener.close()
        op.stop()


@pytest.fixture(scope="module")
def token_cluster():
    """A one-node cluster started the way deploy/ray-cluster.yaml starts one: RAY_AUTH_MODE=token, its
    token in RAY_AUTH_TOKEN."""
    op = Operator(private_dir("hs-tok-"))
    token = "5" * 64
    op.start_head(num_cpus=1, env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
    yield op, token
    op.stop()


@pytest.mark.parametrize("auth, fragment", [
    ({}, "RAY_AUTH_MODE is unset"),
    ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "7" * 64}, "does not accept the token in RAY_AUTH_TOKEN"),
], ids=["no-token", "wrong-token"])
def test_a_token_cluster_refusing_us_is_one_line_naming_the_setting(token_cluster, model_dirs, auth, fragment):
    op, _ = token_cluster
    serve = CloudServe(op, *serve_args(model_dirs, "--ray-address", op.address), env=auth)
    assert serve.wait_exit(FAILS_WITHIN_S) != 0
    assert_one_line(serve, op.address, "InvalidAuthToken", fragment)


def test_a_token_cluster_is_joined_with_its_token(token_cluster, model_dirs, target, random_drafter):
    op, token = token_cluster
    serve = CloudServe(op, *serve_args(model_dirs, "--ray-address", op.address, "--replica-num-cpus", "0.5"),
                       env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
    try:
        address = serve.wait_serving(STARTS_WITHIN_S)
        gen = generate(address, random_drafter, PROMPTS[0], **EVERY_ROUND)
        assert gen.token_ids == greedy_reference(target, PROMPTS[0], NEW_TOKENS)
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.wait_exit(60) == 0
    finally:
        serve.kill()
