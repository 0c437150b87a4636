"""Progress and liveness during long work (issue 56): an open reports how far the verifier has got while
it caches the prompt, the edge shows it, and a replica that stops answering (SIGSTOP) behind a live
front door is found in seconds, not by a deadline scaled to the prompt: the open fails over to another
replica, or fails with a clear error, and the stopped replica gets no new sessions until it answers
again. Real gRPC on localhost; the pool tests on a local Ray cluster with fractional CPUs."""
from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from hybridspec.cloud.api import service
from hybridspec.cloud.api.server import BackgroundServer
from hybridspec.cloud.core import verifier as verifier_module
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.cloud.pool import ray_pool
from hybridspec.cloud.pool.ray_pool import RayPool
from hybridspec.cloud.pool.specs import PoolSettings, PoolSpec, ReplicaSettings, ReplicaSpec
from hybridspec.common.protocol.errors import Unavailable
from hybridspec.common.protocol.wire import OpenProgress, SessionSpec
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.generation import EventKind
from hybridspec.edge.worker import EdgeWorker
from tinymodels import EVERY_ROUND

PROMPT = tuple(4 + (i * 37) % 250 for i in range(240))


@pytest.fixture
def slow_server(target, monkeypatch):
    """A front door over a verifier whose passes take 20 ms each and feed 8 prompt tokens at most, so a
    240-token prefill takes over half a second; progress is reported every 50 ms."""
    monkeypatch.setattr(verifier_module, "PROGRESS_S", 0.05)
    verifier = Verifier(target, VerifierLimits(max_context=512, prefill_chunk=8))
    forward = verifier.engine.forward
    verifier.engine.forward = lambda feeds: time.sleep(0.02) or forward(feeds)
    server = BackgroundServer(verifier)
    yield server
    server.stop()


def test_an_open_reports_how_far_the_prefill_got_until_its_reply(slow_server):
    with VerifierClient(slow_server.address) as client:
        opening = client.begin_open(SessionSpec("", PROMPT))
        updates = list(opening.updates())
        opened = opening.result()
    assert opened.committed_len == len(PROMPT)
    assert len(updates) >= 3 and all(u.total == len(PROMPT) - 1 for u in updates)
    cached = [u.cached for u in updates]
    assert cached == sorted(cached) and cached[-1] > cached[0]


def test_the_edge_reports_the_clouds_progress_before_the_first_token(slow_server, target):
    config = EdgeConfig.of(cloud=slow_server.address, max_new_tokens=4, **EVERY_ROUND)
    with VerifierClient(slow_server.address) as client:
        events = list(EdgeWorker(target, client, config).stream(list(PROMPT)))
    kinds = [e.kind for e in events]
    progress = [e for e in events if e.kind is EventKind.PROGRESS]
    assert progress and kinds.index(EventKind.PROGRESS) < kinds.index(EventKind.COMMIT)
    assert all(e.progress[1] == len(PROMPT) - 1 and "prompt tokens" in e.message for e in progress)


def test_a_server_without_progress_reports_is_asked_as_before(target, monkeypatch):
    """A server from before OpenSessionStream answers UNIMPLEMENTED: the client opens with OpenSession."""
    register = service.VerifierService.register
    monkeypatch.setattr(service.VerifierService, "register", lambda self, server, only=None: register(
        self, server, only=[name for name in (only or service.pb.DESCRIPTOR.services_by_name["Verifier"]
                                              .methods_by_name) if name != "OpenSessionStream"]))
    server = BackgroundServer(Verifier(target, VerifierLimits(max_context=512)))
    try:
        with VerifierClient(server.address) as client:
            assert client.open_session(SessionSpec("", PROMPT)).committed_len == len(PROMPT)
            assert client.open_session(SessionSpec("", PROMPT[:10])).committed_len == 10
    finally:
        server.stop()


# ---- a replica that stops answering -----------------------------------------------------------------

def replica_pid(replica) -> int:
    return ray.get(replica.handle.__ray_call__.remote(lambda actor: os.getpid()))


def model_pid(replica) -> int:
    """The pid of the process a Ray replica runs its model in (PoolSettings.model_process)."""
    return ray.get(replica.handle.__ray_call__.remote(lambda actor: actor.verifier._process.pid))


def stopped(pid: int):
    """SIGSTOP the process; the returned callable SIGCONTs it (idempotent)."""
    os.kill(pid, signal.SIGSTOP)
    state = {"stopped": True}

    def resume():
        if state.pop("stopped", False):
            os.kill(pid, signal.SIGCONT)

    return resume


def pool_of(model_dirs, replicas: int, name: str) -> RayPool:
    spec = ReplicaSpec(str(model_dirs["target"]), ReplicaSettings(device="cpu", torch_threads=1, pass_cost_tokens=0),
                       VerifierLimits(max_context=512, max_sessions=8))
    return RayPool(PoolSpec(spec, PoolSettings(replicas=replicas, replica_num_cpus=0.5), name=name))


def until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.parametrize("which", [replica_pid, model_pid], ids=["actor", "model-process"])
def test_a_stopped_replica_is_a_clear_error_in_seconds_and_gets_no_new_sessions_until_it_answers(
        ray_cluster, model_dirs, monkeypatch, which):
    """One replica, SIGSTOPped behind a live front door: its actor, or only the process it runs its model
    in (then the actor still answers Ray). An open used to wait for its deadline (30 s + 0.1 s a prompt
    token: 54 s here) in silence; now the front door hears nothing for REPLICA_SILENT_S (3 s here) and
    answers UNAVAILABLE naming the cause, and a second open is refused at once rather than sent to it.
    Once it runs again (SIGCONT) and answers a status call, it takes sessions again."""
    monkeypatch.setattr(ray_pool, "REPLICA_SILENT_S", 3.0)
    pool = pool_of(model_dirs, 1, f"stopped-pool-{which.__name__}")
    server = BackgroundServer(pool)
    replica = next(iter(pool.replicas.values()))
    resume = stopped(which(replica))
    try:
        with VerifierClient(server.address, timeout_s=30) as client:
            with pytest.raises(Unavailable, match="stopped answering"):
                client.open_session(SessionSpec("", PROMPT))
            assert not replica.answering
            with pytest.raises(Unavailable, match="stopped answering"):
                client.open_session(SessionSpec("", PROMPT[:5]))
            resume()
            until(lambda: server.call(pool.status()) and replica.answering)
            assert client.open_session(SessionSpec("", PROMPT)).committed_len == len(PROMPT)
    finally:
        resume()
        server.stop()


def test_a_status_call_that_times_out_leaves_new_sessions_to_the_replica(ray_cluster, model_dirs, monkeypatch):
    """A status call the replica does not answer in time (a busy host: here every one, with CHECK_S tiny)
    counts the replica down in the metrics' report, but only an open's silence bars it from new sessions:
    a one-replica pool used to refuse every open until a status call came back in time."""
    pool = pool_of(model_dirs, 1, "slow-status-pool")
    server = BackgroundServer(pool)
    replica = next(iter(pool.replicas.values()))
    monkeypatch.setattr(ray_pool, "CHECK_S", 1e-6)
    try:
        assert [status.alive for status in server.call(pool.status())] == [False]
        assert replica.answering
        with VerifierClient(server.address, timeout_s=30) as client:
            assert client.open_session(SessionSpec("", PROMPT)).committed_len == len(PROMPT)
    finally:
        server.stop()


def test_an_open_on_a_stopped_replica_fails_over_to_another(ray_cluster, model_dirs, monkeypatch):
    """Two replicas; the one the next session would go to is SIGSTOPped: the open is placed again on the
    other one and answered, with no error for the client."""
    monkeypatch.setattr(ray_pool, "REPLICA_SILENT_S", 3.0)
    pool = pool_of(model_dirs, 2, "failover-pool")
    server = BackgroundServer(pool)
    first, second = pool.replicas.values()
    pool.routed_total[second.name] = 1  # the next new session goes to `first`, which is then stopped
    resume = stopped(replica_pid(first))
    try:
        with VerifierClient(server.address, timeout_s=30) as client:
            opening = client.begin_open(SessionSpec("", PROMPT))
            assert all(isinstance(u, OpenProgress) for u in opening.updates())
            assert opening.result().committed_len == len(PROMPT)
        assert not first.answering and pool.table.count(second.name) == 1
    finally:
        resume()
        server.stop()


def test_edge_serve_streams_the_clouds_progress_as_sse_comments(slow_server, target):
    """A streamed completion of a long prompt starts with `: prefill CACHED/TOTAL tokens` comments,
    which the OpenAI client skips: its text is that of the same request unstreamed."""
    import httpx2
    import openai

    from test_serve import make_worker, serving

    with serving(make_worker(slow_server.address, target, max_new_tokens=4)) as (base, model):
        request = {"model": model, "prompt": list(PROMPT), "max_tokens": 4, "stream": True}
        with httpx2.stream("POST", f"{base}/v1/completions", json=request, timeout=60) as reply:
            lines = [line for line in reply.iter_lines() if line]
        comments = [line for line in lines if line.startswith(": prefill ")]
        first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
        assert comments and lines.index(comments[0]) < first_data
        assert all(line.endswith(f"/{len(PROMPT) - 1} tokens") for line in comments)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt=list(PROMPT), max_tokens=4, stream=True))
        whole = client.completions.create(model=model, prompt=list(PROMPT), max_tokens=4).choices[0].text
        assert streamed == whole
