"""A verifier in a process of its own behind the real gRPC front door (`cloud serve --backend process`):
exact output, errors as statuses, a child that dies replaced, starts that fail in one line, nothing left
behind."""
import asyncio
import functools
import os
import signal

import grpc
import psutil
import pytest

from hybridspec.cloud.api.server import BackgroundServer
from hybridspec.cloud.core.limits import VerifierLimits
from hybridspec.cloud.core.telemetry import STEP_ENDS_KEPT, Part, StepClock
from hybridspec.cloud.pool import process_replica
from hybridspec.cloud.pool.process_replica import ProcessReplica, process_pool
from hybridspec.cloud.pool.loading import load_verifier
from hybridspec.cloud.pool.specs import ReplicaSettings, ReplicaSpec
from hybridspec.common.protocol.errors import Unavailable
from hybridspec.common.protocol.proto import verifier_pb2 as pb
from hybridspec.common.protocol.proto import verifier_pb2_grpc as pb_grpc
from hybridspec.common.protocol.wire import GenerateSpec, SessionSpec
from hybridspec.edge.client import VerifierClient

from conftest import EVENT_TIMEOUT_S, eventually, run_edges
from tinymodels import greedy_reference

PROMPTS = [[5 + i, 17, 33 + 2 * i, 80] for i in range(6)]
NEW_TOKENS = 16
LIMITS = VerifierLimits(max_context=512, max_draft=16, max_sessions=16)


def spec_of(path) -> ReplicaSpec:
    return ReplicaSpec(str(path), ReplicaSettings(device="cpu", torch_threads=1, max_wait_ms=5.0), LIMITS)


@pytest.fixture(scope="module")
def process_server(model_dirs):
    """The tiny target's verifier in a child process, behind a front door in this one."""
    pool = process_pool(spec_of(model_dirs["target"]), 16, 16)
    server = BackgroundServer(pool)
    yield server, pool.replicas["process"]
    server.stop()


def child_of(replica: ProcessReplica) -> psutil.Process:
    return psutil.Process(replica._process.pid)


def test_the_verifier_runs_in_a_child_and_concurrent_edges_get_the_target_greedy_output(
        process_server, target, random_drafter):
    server, replica = process_server
    assert child_of(replica).pid != os.getpid()
    for cloud_only in (False, True):
        results = run_edges(server.address, [random_drafter], PROMPTS, NEW_TOKENS, cloud_only=cloud_only)
        for prompt, result in zip(PROMPTS, results):
            assert result.token_ids == greedy_reference(target, prompt, NEW_TOKENS), (cloud_only, prompt)
    stats = server.call(replica.astats())
    assert stats is not None and stats.telemetry is not None


def test_rounds_of_one_step_share_a_pass_and_the_clock_crosses_the_pipe(process_server, random_drafter):
    server, replica = process_server
    assert server.call(replica.step_clock(True)) is None
    run_edges(server.address, [random_drafter], PROMPTS, NEW_TOKENS)
    clock, cpu_s = server.call(replica.step_clock(False))
    assert clock.steps > 0 and clock.rounds > clock.steps, "concurrent edges' rounds should share passes"
    assert clock.cpu[Part.FORWARD] > 0 and cpu_s >= sum(clock.cpu.values())
    assert len(clock.ends) == clock.steps and all(ms > 0 for _, ms in clock.ends)


def test_a_step_clock_left_on_keeps_the_latest_step_ends_only():
    clock = StepClock()
    for _ in range(STEP_ENDS_KEPT + 10):
        clock.start()
        clock.done(1)
    assert clock.steps == STEP_ENDS_KEPT + 10 and len(clock.ends) == STEP_ENDS_KEPT
    assert clock.ends[-1][0] >= clock.ends[0][0]


def test_domain_errors_cross_the_pipe_as_statuses(process_server):
    server, _ = process_server
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Verify(pb.VerifyRequest(session_id="no-such-session", round=0, committed_len=1, draft_ids=[1]))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        opened = stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5, 17, 33]))
        with pytest.raises(grpc.RpcError) as err:  # the child's verifier validates the block: 40 drafts > 16
            stub.Verify(pb.VerifyRequest(session_id=opened.session_id, round=0, committed_len=opened.committed_len,
                                         draft_ids=[1] * 40))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "traceback" not in err.value.details().lower()
        reply = stub.Verify(pb.VerifyRequest(session_id=opened.session_id, round=0,
                                             committed_len=opened.committed_len, draft_ids=[1, 2]))
        assert reply.committed_len > opened.committed_len  # the session survived its bad round
        assert stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id)).existed


def test_a_child_that_dies_is_replaced_and_its_sessions_answer_failed_precondition(process_server, target,
                                                                                    random_drafter):
    server, replica = process_server
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        opened = stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5, 17, 33]))
        old = replica._process.pid
        os.kill(old, signal.SIGKILL)
        eventually(lambda: replica.failures == 1 and replica.alive and replica._process.pid != old,
                   "a new child serving", EVENT_TIMEOUT_S)
        with pytest.raises(grpc.RpcError) as err:
            stub.Verify(pb.VerifyRequest(session_id=opened.session_id, round=0, committed_len=opened.committed_len,
                                         draft_ids=[1]))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not psutil.pid_exists(old) or psutil.Process(old).status() == psutil.STATUS_ZOMBIE
    result = run_edges(server.address, [random_drafter], PROMPTS[:1], NEW_TOKENS)[0]
    assert result.token_ids == greedy_reference(target, PROMPTS[0], NEW_TOKENS)


def test_a_target_that_cannot_load_fails_the_start_in_one_line_and_leaves_no_child(tmp_path):
    replica = ProcessReplica("broken", functools.partial(load_verifier, spec_of(tmp_path / "no-such-model")))

    async def start():
        try:
            await replica.start()
        finally:
            await replica.stop()

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(Unavailable) as err:
        asyncio.run(start())
    assert "could not load its model" in str(err.value) and "\n" not in str(err.value)
    assert {p.pid for p in psutil.Process().children(recursive=True)
            if p.status() != psutil.STATUS_ZOMBIE} <= before
    assert replica.failures == 0 and not replica.alive


def test_a_stopped_replica_leaves_no_process_and_answers_nothing(model_dirs):
    pool = process_pool(spec_of(model_dirs["target"]), 16, 16)
    server = BackgroundServer(pool)
    replica = pool.replicas["process"]
    child = child_of(replica)
    with VerifierClient(server.address) as client:
        assert len(list(client.generate(GenerateSpec(prompt_ids=(5, 17, 33), max_new_tokens=3)))) == 3
    server.stop()
    child.wait(timeout=EVENT_TIMEOUT_S)
    assert not replica.alive and not replica._waiting


def test_a_status_call_that_times_out_leaves_new_sessions_to_the_child(process_server, monkeypatch):
    """A stats call the child does not answer in time (a busy host: here every one, with CHECK_S tiny)
    reports the replica down to the metrics, but only an open's silence bars it from new sessions: the
    process backend's one replica used to refuse every open until a status call came back in time."""
    server, replica = process_server
    monkeypatch.setattr(process_replica, "CHECK_S", 1e-6)
    assert server.call(replica.astats()) is None
    assert replica.answering
    with VerifierClient(server.address) as client:
        assert client.open_session(SessionSpec("", (5, 17, 33))).committed_len == 3
