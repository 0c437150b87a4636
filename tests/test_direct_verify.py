"""Direct verify: rounds and cloud-only streams go from the edge straight to the replica holding the
session (real gRPC, real Ray)."""
import time

import grpc
import pytest
import ray

from hybridspec.cloud.config import ServeConfig
from hybridspec.cloud.pool.ray_pool import ACTOR, RayPool, RayReplica
from hybridspec.cloud.pool.specs import PoolSettings, PoolSpec, ReplicaSettings, ReplicaSpec
from hybridspec.cloud.api.server import BackgroundServer, ReplicaEndpoint
from hybridspec.cloud.core.verifier import VerifierLimits
from hybridspec.common.protocol import codec
from hybridspec.common.protocol.wire import SessionSpec
from hybridspec.common.protocol.proto import verifier_pb2 as pb
from hybridspec.common.protocol.proto import verifier_pb2_grpc as pb_grpc
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.worker import EdgeWorker

from tinymodels import EVERY_ROUND, greedy_reference

PROMPT = [7, 19, 40, 81]
NEW_TOKENS = 20


@pytest.fixture(scope="module", params=[True, False], ids=["model-process", "in-actor"])
def direct_pool(request, ray_cluster, model_dirs):
    """Two replicas, each with its own Verify endpoint on 127.0.0.1, behind a front door: each replica's
    model in a process of its own (the default), or in the actor beside its endpoint."""
    replica = ReplicaSpec(str(model_dirs["target"]), ReplicaSettings(device="cpu", torch_threads=1),
                          VerifierLimits(max_context=512, max_draft=16, max_sessions=8))
    settings = PoolSettings(replicas=2, replica_num_cpus=0.5, model_process=request.param)
    pool = RayPool(PoolSpec(replica, settings, name=f"direct-pool-{request.param_index}"), ReplicaEndpoint("127.0.0.1"))
    server = BackgroundServer(pool, metrics_port=0)
    yield server, pool
    server.stop()


def count_front_door_rounds(pool):
    """Wrap the pool's averify (what the front door's Verify RPCs call) to count the rounds it routes."""
    calls = {"n": 0}
    original = pool.averify

    async def counted(block):
        calls["n"] += 1
        return await original(block)

    pool.averify = counted
    return calls, lambda: vars(pool).pop("averify")


def edge_config(address):
    return EdgeConfig.of(cloud=address, max_new_tokens=NEW_TOKENS, max_draft=3, fallback_threshold=0.0, **EVERY_ROUND)


def counted(server, name: str) -> float:
    """A counter of the front door's metrics, as its /metrics would show it now."""
    return server.running.metrics.registry.get_sample_value(name)


@pytest.mark.slow
def test_rounds_skip_the_front_door_and_give_the_target_greedy_output(direct_pool, target, random_drafter):
    server, pool = direct_pool
    assert all(r.verify_address.startswith("127.0.0.1:") for r in pool.replicas.values())
    calls, restore = count_front_door_rounds(pool)
    try:
        rounds_before = counted(server, "hybridspec_spec_decode_num_drafts_total")
        with VerifierClient(server.address) as client:
            for drafter in (target, random_drafter):  # all accepted / nearly all rejected; one client
                gen = EdgeWorker(drafter, client, edge_config(server.address)).generate(PROMPT)
                assert gen.token_ids == greedy_reference(target, PROMPT, NEW_TOKENS)
                assert client.rounds_address in {r.verify_address for r in pool.replicas.values()}
    finally:
        restore()
    assert calls["n"] == 0  # every round went to a replica's own endpoint
    server.call(server.running.refresh_metrics())  # the replicas' tallies reach the front door's /metrics
    assert counted(server, "hybridspec_spec_decode_num_drafts_total") - rounds_before >= 2 * NEW_TOKENS / 4


@pytest.mark.slow
def test_a_replica_endpoint_serves_only_its_own_sessions_with_clean_statuses(direct_pool):
    server, pool = direct_pool
    with grpc.insecure_channel(server.address) as front:
        opened = pb_grpc.VerifierStub(front).OpenSession(pb.OpenSessionRequest(committed_ids=[5, 6]))
    owner = next(r for r in pool.replicas.values() if r.verify_address == opened.verify_address)
    other = next(r for r in pool.replicas.values() if r is not owner)

    def stream(address, *requests):
        with grpc.insecure_channel(address) as channel:
            return list(pb_grpc.VerifierStub(channel).VerifyStream(iter(requests), timeout=30))

    def refused(address, request, code):
        with pytest.raises(grpc.RpcError) as info:
            stream(address, request)
        assert info.value.code() == code, info.value.details()
        assert "Traceback" not in info.value.details() and opened.session_id not in info.value.details()
        return info.value.details()

    first = pb.VerifyRequest(session_id=opened.session_id, round=0, committed_len=2, draft_ids=[9])
    # Another replica's session, and an id nobody issued: unknown here, nothing said about elsewhere.
    assert "unknown" in refused(other.verify_address, first, grpc.StatusCode.FAILED_PRECONDITION)
    assert "unknown" in refused(owner.verify_address, pb.VerifyRequest(session_id="made-up", round=0, committed_len=1),
                                grpc.StatusCode.FAILED_PRECONDITION)
    assert "64" in refused(owner.verify_address, pb.VerifyRequest(session_id="x" * 9000, round=0, committed_len=1),
                           grpc.StatusCode.INVALID_ARGUMENT)
    # Garbage bytes, and RPCs only the front door serves.
    with grpc.insecure_channel(owner.verify_address) as channel:
        raw = channel.stream_stream("/hybridspec.v1.Verifier/VerifyStream")
        with pytest.raises(grpc.RpcError) as info:
            list(raw(iter([b"\xff\xff\xff garbage"]), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.VerifierStub(channel).OpenSession(pb.OpenSessionRequest(committed_ids=[5]), timeout=30)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # The owner still serves the real session, untouched by all of that.
    assert stream(owner.verify_address, first)[0].committed_len in (3, 4)
    with grpc.insecure_channel(server.address) as front:
        pb_grpc.VerifierStub(front).CloseSession(pb.CloseSessionRequest(session_id=opened.session_id))
    # Closed at the front door: its replica no longer serves it.
    second = pb.VerifyRequest(session_id=opened.session_id, round=1, committed_len=3, draft_ids=[])
    refused(owner.verify_address, second, grpc.StatusCode.FAILED_PRECONDITION)


@pytest.mark.slow
def test_features_travel_through_the_pool_and_the_replica_endpoint(direct_pool, target):
    """Asked-for features survive the Ray hop (open) and the replica's own endpoint (rounds), and count."""
    server, _ = direct_pool
    bytes_before = counted(server, "hybridspec_feature_bytes_total")
    with grpc.insecure_channel(server.address) as front:
        stub = pb_grpc.VerifierStub(front)
        assert stub.GetModelInfo(pb.GetModelInfoRequest()).feature_dim == target.model.config.hidden_size
        opened = stub.OpenSession(pb.OpenSessionRequest(committed_ids=PROMPT, features=pb.FEATURES_INT8))
        with grpc.insecure_channel(opened.verify_address) as channel:
            replies = list(pb_grpc.VerifierStub(channel).VerifyStream(iter([
                pb.VerifyRequest(session_id=opened.session_id, round=0, committed_len=len(PROMPT), draft_ids=[9]),
            ]), timeout=30))
        stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id))
    blocks = [codec.features_from_pb(opened.features), codec.features_from_pb(replies[0].features)]
    assert [(b.start, b.count) for b in blocks] == [(0, len(PROMPT) - 1), (len(PROMPT) - 1, replies[0].num_accepted + 1)]
    for block in blocks:
        block.validate()
    server.call(server.running.refresh_metrics())
    assert counted(server, "hybridspec_feature_bytes_total") - bytes_before == sum(b.nbytes for b in blocks)


@pytest.mark.slow
def test_a_killed_replica_sends_the_edge_back_to_the_front_door(direct_pool, target, random_drafter):
    server, pool = direct_pool
    with VerifierClient(server.address) as client:
        worker = EdgeWorker(random_drafter, client, edge_config(server.address))
        original, calls, killed = client.submit, {"n": 0}, []

        def submit_after_killing(block):
            calls["n"] += 1
            if calls["n"] == 3:  # mid-generation: crash the replica whose endpoint the rounds go to
                replica = pool.replicas[pool.table.get(block.session_id).replica]
                killed.append(replica.verify_address)
                ray.kill(replica.handle, no_restart=False)
            return original(block)

        client.submit = submit_after_killing
        gen = worker.generate(PROMPT)
    assert gen.token_ids == greedy_reference(target, PROMPT, NEW_TOKENS)
    assert gen.stats.reopens >= 1 and killed
    server.call(server.running.refresh_metrics())
    assert server.running.metrics.replica_failures._value.get() >= 1


def test_direct_verify_is_a_config_switch():
    assert ServeConfig().replica_endpoint().host == "127.0.0.1"
    assert ServeConfig.of(host="0.0.0.0", insecure=True).replica_endpoint().host == "0.0.0.0"
    assert ServeConfig.of(direct_verify=False).replica_endpoint() is None


def test_the_in_process_backend_names_no_replica_endpoint(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        opened = stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5, 6]))
        stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id))
    assert opened.verify_address == ""


def count_front_door_decodes(pool):
    """Wrap the pool's adecode (what the front door's Generate and Decode RPCs stream from) to count calls."""
    calls = {"n": 0}
    original = pool.adecode

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    pool.adecode = counted
    return calls, lambda: vars(pool).pop("adecode")


@pytest.mark.slow
def test_cloud_only_tokens_come_straight_from_the_replica(direct_pool, target):
    """Issue "serve real conversations": cloud-only tokens crossed the front door and Ray one by one;
    now the edge opens the stream's session at the front door and decodes on its replica's endpoint."""
    server, pool = direct_pool
    calls, restore = count_front_door_decodes(pool)
    tokens_before = counted(server, "hybridspec_generate_tokens_total")
    try:
        with VerifierClient(server.address) as client:
            config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW_TOKENS, cloud_only=True)
            gen = EdgeWorker(target, client, config).generate(PROMPT)
            assert client.rounds_address in {r.verify_address for r in pool.replicas.values()}
    finally:
        restore()
    assert gen.token_ids == greedy_reference(target, PROMPT, NEW_TOKENS)
    assert calls["n"] == 0 and gen.stats.cloud_only_tokens == NEW_TOKENS
    server.call(server.running.refresh_metrics())  # the replica's tally counts them at the front door
    assert counted(server, "hybridspec_generate_tokens_total") - tokens_before == NEW_TOKENS


def wait_for_replicas(pool, timeout_s=60.0):
    """Until every replica answers again (an earlier test may have killed one)."""
    deadline = time.monotonic() + timeout_s
    while not all(r.alive for r in pool.replicas.values()) and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.mark.slow
def test_a_decode_stream_serves_only_a_session_its_replica_holds(direct_pool):
    server, pool = direct_pool
    wait_for_replicas(pool)
    with grpc.insecure_channel(server.address) as front:
        stub = pb_grpc.VerifierStub(front)
        opened = stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5, 6]))
        other = next(r for r in pool.replicas.values() if r.verify_address != opened.verify_address)
        request = pb.DecodeRequest(session_id=opened.session_id, round=0, committed_len=2, max_new_tokens=3)
        for address, code in ((other.verify_address, grpc.StatusCode.FAILED_PRECONDITION),
                              (opened.verify_address, grpc.StatusCode.INVALID_ARGUMENT)):
            with grpc.insecure_channel(address) as channel:
                bad = request if code is grpc.StatusCode.FAILED_PRECONDITION else pb.DecodeRequest(
                    session_id=opened.session_id, round=0, committed_len=2, max_new_tokens=600)
                with pytest.raises(grpc.RpcError) as info:
                    list(pb_grpc.VerifierStub(channel).Decode(bad, timeout=30))
                assert info.value.code() == code and "Traceback" not in info.value.details()
        assert "max_context of 512" in info.value.details()
        with grpc.insecure_channel(opened.verify_address) as channel:
            tokens = [r.token_id for r in pb_grpc.VerifierStub(channel).Decode(request, timeout=30)]
        assert len(tokens) == 3  # and the session went on: its next round is the fourth
        verdict = stub.Verify(pb.VerifyRequest(session_id=opened.session_id, round=3, committed_len=5))
        assert verdict.committed_len == 6
        stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id))


@pytest.mark.slow
def test_a_killed_replica_mid_stream_is_recovered_at_the_front_door(direct_pool, target):
    server, pool = direct_pool
    with VerifierClient(server.address) as client:
        original, killed = client.decode, []

        def decode_then_kill(spec):
            stream = original(spec)
            if not killed:  # the first stream: crash its replica once it has sent a token or two
                replica = pool.replicas[pool.table.get(spec.session_id).replica]
                killed.append(replica.verify_address)
                ray.kill(replica.handle, no_restart=False)
            return stream

        client.decode = decode_then_kill
        config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW_TOKENS, cloud_only=True)
        gen = EdgeWorker(target, client, config).generate(PROMPT)
    assert gen.token_ids == greedy_reference(target, PROMPT, NEW_TOKENS)
    assert gen.stats.reopens >= 1 and killed



def test_a_replica_ray_restarted_unseen_serves_at_its_new_endpoint(direct_pool, model_dirs):
    """CI found it: a replica killed while no call of the pool reached it is restarted by Ray and the
    pool never hears of it, so nobody calls the new actor's `ready`. Its first open must still start it
    (model thread, endpoint) and name its new endpoint, and the pool must learn that address."""
    server, pool = direct_pool
    spec = PoolSpec(ReplicaSpec(str(model_dirs["target"]), ReplicaSettings(device="cpu", torch_threads=1,
                                                                          pass_cost_tokens=0),
                                VerifierLimits(max_context=512, max_draft=16, max_sessions=8)),
                    PoolSettings(replicas=1, replica_num_cpus=0.25), name="unseen")
    model_process = next(iter(pool.replicas.values())).spec.settings.model_process  # as the fixture's replicas
    replica = RayReplica("unseen-replica", spec, ReplicaEndpoint("127.0.0.1"))
    # As Ray restarts it:
    replica.handle = ACTOR.options(num_cpus=0.25).remote(spec.replica, replica.endpoint, model_process)
    ray.get(replica.handle.take_tally.remote(), timeout=120)  # constructed (take_tally starts nothing)
    replica.alive, replica.address = True, "127.0.0.1:1"  # what the pool believes: the dead actor's endpoint
    try:
        opened = server.call(replica.aopen_session(SessionSpec("s", (5, 6))))
        assert opened.verify_address not in ("", "127.0.0.1:1")
        assert replica.verify_address == opened.verify_address
        with grpc.insecure_channel(opened.verify_address) as channel:
            replies = list(pb_grpc.VerifierStub(channel).VerifyStream(iter([
                pb.VerifyRequest(session_id="s", round=0, committed_len=2)]), timeout=60))
        assert [r.committed_len for r in replies] == [3]
    finally:
        ray.kill(replica.handle, no_restart=True)
