"""The Ray verifier pool behind the real gRPC front door: affinity, batching, recovery, statuses, metrics."""
import asyncio
import contextlib
import os
import signal
import time
import urllib.request

import grpc
import psutil
import pytest
import ray

from hybridspec.cloud.pool.ray_pool import RayPool
from hybridspec.cloud.pool.specs import PoolSettings, PoolSpec, ReplicaSettings, ReplicaSpec
from hybridspec.cloud.api.server import BackgroundServer
from hybridspec.cloud.core.limits import Hold
from hybridspec.cloud.core.verifier import VerifierLimits
from hybridspec.common.protocol.proto import verifier_pb2 as pb
from hybridspec.common.protocol.proto import verifier_pb2_grpc as pb_grpc
from hybridspec.common.protocol.errors import Unavailable
from hybridspec.common.protocol.wire import GenerateSpec
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.worker import EdgeWorker

from conftest import REPLICA_RESTART_S, run_edges
from tinymodels import EVERY_ROUND, greedy_reference

MAX_SESSIONS = 8  # per replica
PROMPTS = [[5 + i, 17, 33 + 2 * i, 80] for i in range(8)]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def pool_server(ray_cluster, model_dirs):
    """Two replica actors (half a Ray CPU each) behind a front door with a /metrics endpoint."""
    # Generous, and waiting for every recently active session, so that concurrent test edges really share
    # passes. The default (cohort) waits only for the sessions the same pass answered: edges whose first
    # rounds miss each other by more than the wait keep passes of their own unless their rounds happen to
    # arrive together (a CI run saw 100 rounds in 100 passes), which is that policy's choice, not what
    # these tests are about.
    settings = ReplicaSettings(device="cpu", torch_threads=1, max_batch_size=16, max_wait_ms=20.0, hold=Hold.COMPANY)
    replica = ReplicaSpec(str(model_dirs["target"]), settings,
                          VerifierLimits(max_context=512, max_draft=16, max_sessions=MAX_SESSIONS))
    pool = RayPool(PoolSpec(replica, PoolSettings(replicas=2, replica_num_cpus=0.5), name="test-pool"))
    server = BackgroundServer(pool, metrics_port=0)
    yield server, pool
    server.stop()


def metric(server, name: str, **labels) -> float:
    """One sample of the front door's /metrics, as Prometheus would scrape it."""
    server.call(server.running.refresh_metrics())
    url = f"http://127.0.0.1:{server.running.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    total = 0.0
    for line in text.splitlines():
        if line.startswith(want + " ") or (not labels and line.startswith(name + "{")):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.slow
def test_eight_concurrent_edges_get_the_target_greedy_output(pool_server, target, random_drafter):
    server, pool = pool_server
    routed_before = [metric(server, "hybridspec_sessions_routed_total", replica=name) for name in pool.replicas]
    batches_before = metric(server, "hybridspec_batch_size_count")
    singles_before = metric(server, "hybridspec_batch_size_bucket", le="1.0")
    gens = run_edges(server.address, [target, random_drafter], PROMPTS, NEW_TOKENS, max_draft=4, fallback_threshold=0.0)
    for prompt, gen in zip(PROMPTS, gens):
        assert gen.token_ids == greedy_reference(target, prompt, NEW_TOKENS)
    routed = [metric(server, "hybridspec_sessions_routed_total", replica=name) - b
              for name, b in zip(pool.replicas, routed_before)]
    assert all(n >= 2 for n in routed), routed  # spread over both replicas
    batches = metric(server, "hybridspec_batch_size_count") - batches_before
    singles = metric(server, "hybridspec_batch_size_bucket", le="1.0") - singles_before
    assert batches > 0 and singles < batches  # some rounds shared a forward pass


@pytest.mark.slow
def test_killed_replica_is_recovered_transparently(pool_server, target, random_drafter):
    server, pool = pool_server
    reopens_before = metric(server, "hybridspec_session_reopens_total")
    failures_before = metric(server, "hybridspec_replica_failures_total")
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW_TOKENS, max_draft=3, fallback_threshold=0.0,
                           **EVERY_ROUND)
    prompt = PROMPTS[3]
    with VerifierClient(server.address) as client:
        worker = EdgeWorker(random_drafter, client, config)
        original, calls = client.submit, {"n": 0}

        def submit_after_killing(block):
            calls["n"] += 1
            if calls["n"] == 3:  # mid-generation: crash the process that holds this session's cache
                ray.kill(pool.replicas[pool.table.get(block.session_id).replica].handle, no_restart=False)
            return original(block)

        client.submit = submit_after_killing  # the real call still goes over gRPC to the pool
        gen = worker.generate(prompt)
    assert gen.token_ids == greedy_reference(target, prompt, NEW_TOKENS)
    assert gen.stats.reopens >= 1
    assert metric(server, "hybridspec_session_reopens_total") > reopens_before
    assert metric(server, "hybridspec_replica_failures_total") > failures_before
    deadline = time.monotonic() + REPLICA_RESTART_S
    while not all(r.alive for r in pool.replicas.values()):  # Ray restarts it; later tests want both back
        assert time.monotonic() < deadline, "the killed replica did not come back"
        time.sleep(0.5)


def model_pid(replica) -> int:
    """The pid of the process a Ray replica runs its model in (PoolSettings.model_process)."""
    return ray.get(replica.handle.__ray_call__.remote(lambda actor: actor.verifier._process.pid))


@pytest.mark.slow
@pytest.mark.parametrize("crash", ["actor", "model-process"])
def test_a_crash_of_the_only_replica_is_survived(ray_cluster, model_dirs, target, random_drafter, crash):
    """Regression: with one replica the edge used to fail with UNAVAILABLE; it now waits for Ray to
    restart the replica and re-opens from its committed tokens. The crash kills the actor, or only the
    process it runs its model in: the actor then exits too, for Ray to restart. Either way the crashed
    replica's model process is gone: none is left holding a device's memory beside the new one."""
    replica = ReplicaSpec(str(model_dirs["target"]), ReplicaSettings(device="cpu", torch_threads=1),
                          VerifierLimits(max_context=512, max_draft=16, max_sessions=MAX_SESSIONS))
    pool = RayPool(PoolSpec(replica, PoolSettings(replicas=1, replica_num_cpus=0.5), name=f"solo-pool-{crash}"))
    server = BackgroundServer(pool)
    solo = next(iter(pool.replicas.values()))
    first_model = model_pid(solo)
    assert first_model != ray.get(solo.handle.__ray_call__.remote(lambda actor: os.getpid()))
    try:
        config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW_TOKENS, max_draft=3, fallback_threshold=0.0,
                               **EVERY_ROUND)
        with VerifierClient(server.address) as client:
            worker = EdgeWorker(random_drafter, client, config)
            original, calls = client.submit, {"n": 0}

            def submit_after_killing(block):
                calls["n"] += 1
                if calls["n"] == 3 and crash == "actor":
                    ray.kill(solo.handle, no_restart=False)
                elif calls["n"] == 3:
                    os.kill(first_model, signal.SIGKILL)
                return original(block)

            client.submit = submit_after_killing
            gen = worker.generate(PROMPTS[5])
        assert gen.token_ids == greedy_reference(target, PROMPTS[5], NEW_TOKENS)
        assert gen.stats.reopens >= 1
        assert solo.failures == 1
        assert model_pid(solo) != first_model
        deadline = time.monotonic() + REPLICA_RESTART_S
        while psutil.pid_exists(first_model) and psutil.Process(first_model).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the crashed replica's model process outlived it"
            time.sleep(0.2)
    finally:
        server.stop()


@pytest.mark.parametrize("model_process", [True, False], ids=["model-process", "in-actor"])
def test_a_replica_that_cannot_load_its_model_fails_the_start_in_one_line_and_leaves_nothing(ray_cluster, tmp_path,
                                                                                           model_process):
    """Whether the actor loads the model itself or a process of its own does, the pool's start fails with
    one line naming the replica and the cause, and neither the actor nor a model process is left (Ray would
    otherwise restart a replica whose model will never load, for good)."""
    replica = ReplicaSpec(str(tmp_path / "no-such-model"), ReplicaSettings(device="cpu", torch_threads=1))
    name = f"broken-pool-{model_process}"
    pool = RayPool(PoolSpec(replica, PoolSettings(replicas=1, replica_num_cpus=0.5, model_process=model_process),
                            name=name))
    with pytest.raises(Unavailable) as err:
        asyncio.run(pool.start())
    assert str(err.value).startswith("a verifier replica failed to start: ") and "\n" not in str(err.value)
    deadline = time.monotonic() + 30
    while True:  # a dead named actor can no longer be looked up
        try:
            ray.get_actor(f"{name}-replica-0")
        except ValueError:
            break
        assert time.monotonic() < deadline, "the broken replica's actor was left alive"
        time.sleep(0.5)


def test_replicas_run_at_the_operators_niceness_not_rays(pool_server):
    """Ray starts workers at niceness 15, where a replica yields its core to anything else on the node;
    the pool starts them at PoolSettings.replica_niceness (0 by default). The niceness is added to the
    one the cluster's processes inherit from the process that started it: this test's, 10 under `nice`.
    Only this session's replicas count: another test run on the machine may run at another niceness."""
    replicas = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # a child that just ended has no command line
            if (child.cmdline() or [""])[0].startswith("ray::VerifierReplica"):
                replicas.append(child.nice())
    assert len(replicas) >= 2
    assert set(replicas) == {os.getpriority(os.PRIO_PROCESS, 0)}


def test_a_local_cluster_keeps_no_idle_workers_beside_the_replicas(pool_server):
    """Ray prestarts workers for tasks the pool never runs; each would poll for about 1 % of a core that
    a replica on the same host decodes with."""
    names = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # a child that just ended (or a zombie) has no command line
            names.append((child.cmdline() or [""])[0])
    assert any(name.startswith("ray::VerifierReplica") for name in names)
    assert not [name for name in names if name.startswith("ray::IDLE")]


def test_a_local_clusters_log_monitor_lists_the_log_directory_rarely(pool_server):
    """The log monitor forwards output to drivers that ask for it, which the pool never does; by default
    it would list the log directory ten times a second on the replicas' host."""
    monitors = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(part.endswith("log_monitor.py") for part in child.cmdline()):
                monitors.append(child.environ())
    assert monitors
    assert all(env.get("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD") == "0" for env in monitors)


def test_replicas_report_their_pass_costs(pool_server):
    """Once measured (while serving) or read from the curve cache (cloud/core/cost_cache.py)."""
    server, pool = pool_server
    deadline = time.monotonic() + 120
    with VerifierClient(server.address) as client:
        while not (info := client.model_info()).pass_costs and time.monotonic() < deadline:
            time.sleep(0.2)
    # The default pass_cost_tokens (32): below a whole round of the largest tree (64 nodes + the root).
    assert info.pass_costs[0][0] == 1 and info.pass_costs[-1][0] == 32
    assert all(ms > 0 for _, ms in info.pass_costs)


def test_cloud_only_generate_through_the_pool(pool_server, target):
    server, _ = pool_server
    with VerifierClient(server.address) as client:
        tokens = list(client.generate(GenerateSpec(prompt_ids=tuple(PROMPTS[1]), max_new_tokens=NEW_TOKENS)))
    assert tokens == greedy_reference(target, PROMPTS[1], NEW_TOKENS)


def test_bad_and_over_limit_requests_get_their_status(pool_server):
    server, pool = pool_server
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        first = stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5, 6])).session_id
        with pytest.raises(grpc.RpcError) as info:
            stub.Verify(pb.VerifyRequest(session_id=first, round=0, committed_len=2, draft_ids=[4, 999]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "draft_ids[1] = 999" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.Verify(pb.VerifyRequest(session_id="never-opened", round=0, committed_len=1))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        opened = [first]
        try:
            for _ in range(1, 2 * MAX_SESSIONS):
                opened.append(stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5])).session_id)
            with pytest.raises(grpc.RpcError) as info:
                stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5]))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            for sid in opened:
                stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        # Still serving, with room again.
        after = stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5])).session_id
        assert stub.Verify(pb.VerifyRequest(session_id=after, round=0, committed_len=1)).committed_len == 2
        stub.CloseSession(pb.CloseSessionRequest(session_id=after))
    assert metric(server, "hybridspec_errors_total", code="RESOURCE_EXHAUSTED") >= 1


def test_health_is_serving_and_metrics_count_rounds(pool_server, target):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server, pool = pool_server
    # Rounds of its own to count (the tests before it may be deselected, as the fast tier does).
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW_TOKENS, max_draft=3, fallback_threshold=0.0,
                           **EVERY_ROUND)
    with VerifierClient(server.address) as client:
        assert EdgeWorker(target, client, config).generate(PROMPTS[0]).stats.rounds > 0
    with grpc.insecure_channel(server.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="")).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert metric(server, "hybridspec_spec_decode_num_drafts_total") > 0
    assert metric(server, "hybridspec_replicas_alive") == 2
    drafted0 = metric(server, "hybridspec_spec_decode_num_draft_tokens_per_pos_total", position="0")
    accepted0 = metric(server, "hybridspec_spec_decode_num_accepted_tokens_per_pos_total", position="0")
    assert drafted0 >= accepted0 > 0
    # What the replicas measure themselves arrives with their status, one series per replica.
    replicas = tuple(pool.replicas)
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.running.metrics_port}/metrics", timeout=10).read().decode()
    for replica in replicas:
        assert f'hybridspec_kv_cache_usage_perc{{replica="{replica}"}}' in text
        assert 0 <= metric(server, "hybridspec_kv_cache_usage_perc", replica=replica) <= 1
        assert metric(server, "hybridspec_pass_fixed_seconds", replica=replica) >= 0
    # The edge sent its rounds one after another, each well within 0.5 s of its answer: the replica that
    # served them measured how soon it came back (the auto hold's other input), and no more than a round.
    returns = [metric(server, "hybridspec_edge_return_seconds", replica=r) for r in replicas]
    assert any(0 < r < 0.5 for r in returns), returns
    assert sum(metric(server, "hybridspec_iteration_tokens_total_count", replica=r) for r in replicas) > 0
    assert sum(metric(server, "hybridspec_time_to_first_token_seconds_count", replica=r) for r in replicas) > 0
    assert sum(metric(server, "hybridspec_inter_token_latency_seconds_count", replica=r) for r in replicas) > 0


def test_the_front_door_of_a_ray_pool_never_imports_torch(model_dirs):
    """It loads no model: torch (hundreds of MiB resident) is for the replicas' processes only."""
    script = f"""
import sys
from hybridspec.cli.main import build_parser
from hybridspec.cli.cloud_cmd import _backend, serve_config
import hybridspec.cloud.api.server
args = build_parser().parse_args(["cloud", "serve", "--target", {str(model_dirs["target"])!r}, "--device", "auto"])
backend, what = _backend(serve_config(args))
print(*{{type(r).__name__ for r in backend.replicas.values()}}, "torch" in sys.modules, "transformers" in sys.modules)
"""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["RayReplica", "False", "False"]
