"""No client can change another's output: regression tests for the defects a hostile client found.

Each test names the defect it pins down; each failed on the code before the fix (same scenario).
"""
import copy
import re
import threading
import time
import urllib.request

import grpc
import pytest
import torch

from hybridspec.cloud.pool.pool import inprocess_pool
from hybridspec.cloud.api.server import BackgroundServer
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.common.security.credentials import anonymous
from hybridspec.common.protocol.errors import FailedPrecondition, Internal
from hybridspec.common.models.loading import LoadedModel
from hybridspec.common.protocol.proto import verifier_pb2 as pb
from hybridspec.common.protocol.proto import verifier_pb2_grpc as pb_grpc
from hybridspec.common.protocol.wire import DraftBlock, Mode, SamplingParams, SessionSpec
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.worker import EdgeWorker

from conftest import eventually, started
from tinymodels import EVERY_ROUND, greedy_reference

LIMITS = VerifierLimits(max_context=512, max_draft=16, max_sessions=32)
POISON_TOKEN = 7  # the broken model's logit for this token is NaN


@pytest.fixture
def stub_of():
    channels = []

    def make(server: BackgroundServer) -> pb_grpc.VerifierStub:
        channels.append(grpc.insecure_channel(server.address))
        return pb_grpc.VerifierStub(channels[-1])

    yield make
    for channel in channels:
        channel.close()


@pytest.fixture(scope="module")
def broken_target(target) -> LoadedModel:
    """The tiny target with one NaN row in its output head: argmax still works, sampling cannot.

    A real failure after the forward pass, for one kind of session only (no mocks)."""
    model = copy.deepcopy(target.model)
    with torch.no_grad():
        model.get_output_embeddings().weight[POISON_TOKEN] = float("nan")
    return LoadedModel(target.name, model, target.tokenizer, target.device)


def details(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(request)
    return info.value.code(), info.value.details()


def scrape(server: BackgroundServer, name: str) -> float:
    url = f"http://127.0.0.1:{server.running.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


# ---- 1. one session poisons a shared batch --------------------------------------------------------

def test_denormal_temperature_is_refused_before_any_state(server, stub_of):
    stub = stub_of(server)
    for bad in (1e-40, 1e-4, float("nan"), float("inf"), 1e9):
        code, text = details(stub.OpenSession, pb.OpenSessionRequest(
            committed_ids=[5, 6], sampling=pb.SamplingParams(temperature=bad)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in text


def test_a_failing_session_fails_alone_and_its_batch_mates_commit(broken_target):
    verifier = Verifier(broken_target, LIMITS)
    verifier.open_session(SessionSpec("greedy", (5, 6, 9)))
    verifier.open_session(SessionSpec("sampled", (5, 6, 9), sampling=SamplingParams(temperature=1.0),
                                      mode=Mode.SPECULATIVE))
    alone = Verifier(broken_target, LIMITS)
    alone.open_session(SessionSpec("greedy", (5, 6, 9)))
    expected = alone.verify(DraftBlock("greedy", 0, 3, (11, 12)))
    q = ((POISON_TOKEN,),), ((1.0,),)
    good, bad = verifier.verify_batch([DraftBlock("greedy", 0, 3, (11, 12)),
                                       DraftBlock("sampled", 0, 3, (POISON_TOKEN,), *q)])
    assert isinstance(bad, Internal) and "incident" in str(bad)
    assert (good.num_accepted, good.next_token, good.committed_len) == \
        (expected.num_accepted, expected.next_token, expected.committed_len)
    # The greedy session goes on exactly as it would have alone.
    nxt, nxt_alone = (v.verify(DraftBlock("greedy", 1, good.committed_len, (13,))) for v in (verifier, alone))
    assert (nxt.num_accepted, nxt.next_token, nxt.committed_len) == \
        (nxt_alone.num_accepted, nxt_alone.next_token, nxt_alone.committed_len)


# ---- 2. failed rounds grow the cache without bound ------------------------------------------------

def test_failed_rounds_leave_the_cache_at_the_committed_length(broken_target):
    verifier = Verifier(broken_target, LIMITS)
    verifier.open_session(SessionSpec("sampled", (5, 6, 9), sampling=SamplingParams(temperature=1.0),
                                      mode=Mode.SPECULATIVE))
    q = ((POISON_TOKEN,),) * 16, ((1.0,),) * 16
    for _ in range(40):  # 40 × 17 positions would be 680 > max_context if failures kept their KV
        (result,) = verifier.verify_batch([DraftBlock("sampled", 0, 3, (POISON_TOKEN,) * 16, *q)])
        assert isinstance(result, Internal)
    session = verifier._sessions.get("sampled")
    assert session.kv.length == len(session.committed) - 1 == 2
    assert len(session.kv.pages) == 1  # the pages the failed blocks took went back to the pool


def test_internal_errors_reach_the_client_as_an_incident_id_only(broken_target, stub_of):
    srv = BackgroundServer(inprocess_pool(Verifier(broken_target, LIMITS)), metrics_port=0)
    try:
        stub = stub_of(srv)
        sid = stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5, 6], sampling=pb.SamplingParams(
            temperature=1.0))).session_id
        code, text = details(stub.Verify, pb.VerifyRequest(
            session_id=sid, round=0, committed_len=2, draft_ids=[POISON_TOKEN],
            draft_probs=[pb.DraftPosition(support_ids=[POISON_TOKEN], probs=[1.0])]))
        assert code == grpc.StatusCode.INTERNAL
        assert re.search(r"incident [0-9a-f]{8}", text) and "Traceback" not in text and len(text) < 200
        assert scrape(srv, 'hybridspec_errors_total{code="INTERNAL"}') == 1
    finally:
        srv.stop()


def test_an_edge_beside_a_hostile_client_gets_the_target_output(target, stub_of):
    """Over real gRPC with batching: a client sending poison next to an honest edge changes nothing."""
    srv = BackgroundServer(inprocess_pool(Verifier(target, LIMITS, max_batch=16, max_wait_ms=20.0)))
    stop = threading.Event()

    def hostile() -> None:
        stub = stub_of(srv)
        while not stop.is_set():
            for request in (pb.OpenSessionRequest(committed_ids=[5, 6], sampling=pb.SamplingParams(temperature=1e-40)),
                            pb.VerifyRequest(session_id="guess", round=0, committed_len=2, draft_ids=[999])):
                with pytest.raises(grpc.RpcError):
                    (stub.OpenSession if isinstance(request, pb.OpenSessionRequest) else stub.Verify)(request)

    attacker = threading.Thread(target=hostile)
    attacker.start()
    try:
        prompt = [5, 17, 33, 80]
        config = EdgeConfig.of(cloud=srv.address, max_new_tokens=24, max_draft=4, fallback_threshold=0.0, **EVERY_ROUND)
        with VerifierClient(srv.address) as client:
            gen = EdgeWorker(target, client, config).generate(prompt)
        assert gen.token_ids == greedy_reference(target, prompt, 24)
    finally:
        stop.set()
        attacker.join()
        srv.stop()


# ---- 3. sessions can be hijacked; errors reveal other sessions' state -----------------------------

def test_session_ids_are_issued_by_the_server_and_cannot_be_taken_over(server, stub_of, target):
    stub = stub_of(server)
    prompt = [5, 17, 33, 80] * 9 + [40]  # 37 tokens
    ids = set()
    for _ in range(30):
        sid = stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5])).session_id
        assert stub.CloseSession(pb.CloseSessionRequest(session_id=sid)).existed
        ids.add(sid)
    assert len(ids) == 30 and all(len(i) >= 24 for i in ids)  # fresh, random, long
    victim = stub.OpenSession(pb.OpenSessionRequest(session_id="victim", committed_ids=prompt)).session_id
    assert victim != "victim"  # a client cannot choose its id
    length = len(prompt)
    for r in range(5):
        length = stub.Verify(pb.VerifyRequest(session_id=victim, round=r, committed_len=length)).committed_len
    # An attacker re-opening any id it can name gets a session of its own, never the victim's.
    for guess in ("victim", victim[:-1] + ("A" if victim[-1] != "A" else "B"), ""):
        hijack = stub.OpenSession(pb.OpenSessionRequest(session_id=guess, committed_ids=[9, 9, 9], next_round=5))
        assert hijack.session_id not in (victim, guess)
    reply = stub.Verify(pb.VerifyRequest(session_id=victim, round=5, committed_len=length))
    assert reply.committed_len == length + 1
    assert reply.next_token == greedy_reference(target, prompt, 6)[5]
    # Errors say what the request got wrong, not what the session holds (next round 6, length 43).
    _, text = details(stub.Verify, pb.VerifyRequest(session_id=victim, round=9, committed_len=length + 1))
    assert "6" not in text
    _, text = details(stub.Verify, pb.VerifyRequest(session_id=victim, round=6, committed_len=3))
    assert str(length + 1) not in text


# ---- 4. replays matched by round number only --------------------------------------------------------

def test_a_replay_is_answered_only_for_the_identical_request(server, stub_of):
    stub = stub_of(server)
    sid = stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5, 6, 7])).session_id
    request = pb.VerifyRequest(session_id=sid, round=0, committed_len=3, draft_ids=[9, 9])
    first = stub.Verify(request)
    assert stub.Verify(request).next_token == first.next_token  # identical: the stored answer
    for draft in ([200, 201, 202], [9], [9, 9, 9], []):
        code, text = details(stub.Verify, pb.VerifyRequest(session_id=sid, round=0, committed_len=3, draft_ids=draft))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "different block" in text
    code, _ = details(stub.Verify, pb.VerifyRequest(session_id=sid, round=0, committed_len=3, draft_ids=[9, 999]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT  # out of vocabulary is refused, not "replayed"
    assert stub.Verify(pb.VerifyRequest(session_id=sid, round=1, committed_len=first.committed_len)).round == 1


# ---- 6. one long prefill starves everyone; one client takes every slot ----------------------------

# (rounds between the chunks of a long prefill: tests/test_batched_verification.py, the scheduler's job)


def test_one_client_cannot_take_every_session_slot(target, stub_of):
    backend = inprocess_pool(Verifier(target, LIMITS), max_sessions_per_address=3)
    srv = BackgroundServer(backend)
    try:
        stub = stub_of(srv)
        for _ in range(3):
            stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5]))
        code, text = details(stub.OpenSession, pb.OpenSessionRequest(committed_ids=[5]))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "already hold 3 sessions" in text
        # Another client (a different peer address) still gets a session.
        spec = SessionSpec("", (5, 6))
        opened = srv.call(backend.open_session(spec, anonymous("ipv4:192.0.2.1")))
        assert opened.committed_len == 2
    finally:
        srv.stop()


def test_an_open_that_times_out_gives_the_client_its_slot_back(target, stub_of):
    """Found in review: a deadline (or a client gone) cancelled the open and kept its slot for good."""
    verifier = Verifier(target, VerifierLimits(max_context=512, max_draft=16, prefill_chunk=1))
    srv = BackgroundServer(inprocess_pool(verifier, max_sessions_per_address=1))
    try:
        stub = stub_of(srv)
        long_prompt = pb.OpenSessionRequest(committed_ids=list(range(4, 254)) * 2)  # 500 one-token chunks
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as info:
                stub.OpenSession(long_prompt, timeout=0.05)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5, 6]), timeout=30).session_id
    finally:
        srv.stop()


# ---- 7. the routing table leaks; unbounded ids --------------------------------------------------------

def test_routes_of_sessions_a_replica_expired_are_dropped(target):
    backend = inprocess_pool(Verifier(target, VerifierLimits(max_context=512, idle_timeout_s=1)),
                             max_sessions_per_address=4)
    srv = BackgroundServer(backend)
    try:
        with grpc.insecure_channel(srv.address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            for _ in range(4):
                stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5, 6]))
            assert len(backend.table) == 4

            def dropped() -> bool:
                srv.call(srv.running.refresh_metrics())  # the front door asks its replica what it holds
                return len(backend.table) == 0

            eventually(dropped, "the routes of the sessions the replica expired (idle for 1 s) dropped")
            for _ in range(4):  # the client's count went with them: it has its 4 slots back
                stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5, 6]))
    finally:
        srv.stop()


def test_a_replica_that_never_holds_forgets_the_sessions_that_went_quiet(target):
    """What the model thread keeps per session for batching (when its last round came, which pass took it,
    when it was answered) must go with the session. Closing forgets it; a session abandoned without a
    close expires from the store, and a replica whose hold never runs (max_wait_ms 0) never pruned it:
    one entry per abandoned session, for good."""
    limits = VerifierLimits(max_context=512, max_sessions=2, idle_timeout_s=1)
    verifier = Verifier(target, limits, max_wait_ms=0)
    with started(verifier):
        for batch in range(4):
            for i in range(limits.max_sessions):
                sid = f"abandoned-{batch}-{i}"
                length = verifier.submit_open(SessionSpec(sid, (5, 6))).result(30).committed_len
                verifier.submit_round(DraftBlock(sid, 0, length, ())).result(30)
            time.sleep(1.1)  # idle past the timeout: the store expires them at the next open
        kept = (verifier._recent, verifier._cohort, verifier._returns._answered)  # the step's own state
        assert all(len(table) <= limits.max_sessions for table in kept), [len(table) for table in kept]


def test_oversized_session_ids_are_refused_unread(server, stub_of):
    stub = stub_of(server)
    huge = "x" * 9000
    for call, request in ((stub.Verify, pb.VerifyRequest(session_id=huge, round=0, committed_len=1)),
                          (stub.OpenSession, pb.OpenSessionRequest(session_id=huge, committed_ids=[5])),
                          (stub.CloseSession, pb.CloseSessionRequest(session_id=huge))):
        code, text = details(call, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "xxxx" not in text and len(text) < 100


def test_a_direct_callers_block_of_no_session_is_refused_by_the_lookup_before_validation(target):
    """The servicer checks a session id's length; a caller driving the verifier directly gets an id no
    session has refused by the session lookup that comes before `DraftBlock.validate`, unechoed."""
    verifier = Verifier(target, LIMITS)
    for session_id in ("", "x" * 9000):
        with pytest.raises(FailedPrecondition) as info:
            verifier.verify(DraftBlock(session_id, 0, 1, ()))
        assert "xxxx" not in str(info.value)


# ---- 8. undecodable bodies get UNKNOWN --------------------------------------------------------------

def test_undecodable_bodies_are_invalid_argument_and_counted(target):
    srv = BackgroundServer(Verifier(target, LIMITS), metrics_port=0)
    try:
        with grpc.insecure_channel(srv.address) as channel:
            for method in ("GetModelInfo", "OpenSession", "Verify", "CloseSession"):
                raw = channel.unary_unary(f"/hybridspec.v1.Verifier/{method}", request_serializer=lambda b: b,
                                          response_deserializer=lambda b: b)
                code, text = details(raw, b"\xff\xff\xff\xff\x0f")
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in text, method
            stream = channel.stream_stream("/hybridspec.v1.Verifier/VerifyStream", request_serializer=lambda b: b,
                                           response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as info:
                list(stream(iter([b"\x0a\xff"])))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert scrape(srv, 'hybridspec_errors_total{code="INVALID_ARGUMENT"}') == 5
    finally:
        srv.stop()


# ---- 9. a refused message on a shared stream (probe: one 30 s stall in 1,248, not reproduced) --------

@pytest.mark.parametrize("second", ["out_of_vocabulary", "undecodable", "nothing"])
def test_a_refused_message_ends_its_stream_at_once_after_the_answered_rounds(server, stub_of, second):
    """A valid round of one session, a wrong committed length for another, then more, on one stream
    that the client keeps open: the valid round is answered, the refusal ends the call with its status
    at once, and neither session changes because of the refusal (`92253c5:bench/stalls.py refusals` ran
    this mix for minutes)."""
    stub = stub_of(server)
    channel = grpc.insecure_channel(server.address)
    try:
        stream = channel.stream_stream("/hybridspec.v1.Verifier/VerifyStream", request_serializer=lambda b: b,
                                       response_deserializer=pb.VerifyReply.FromString)
        for _ in range(20):
            a, b = (stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5, 6, 7])).session_id for _ in range(2))
            messages = [pb.VerifyRequest(session_id=a, round=0, committed_len=3, draft_ids=[9]).SerializeToString(),
                        pb.VerifyRequest(session_id=b, round=0, committed_len=42).SerializeToString()]
            if second == "out_of_vocabulary":
                messages.append(pb.VerifyRequest(session_id=b, round=0, committed_len=3,
                                                 draft_ids=[4, 999]).SerializeToString())
            elif second == "undecodable":
                messages.append(b"\x0a\xff\xff")
            held = threading.Event()  # the client never half-closes until the call has ended

            def requests():
                yield from messages
                held.wait(30)

            call = stream(requests(), timeout=30)
            replies = []
            with pytest.raises(grpc.RpcError) as info:
                for reply in call:
                    replies.append(reply)
            held.set()
            # At once: a stream left waiting for the client to half-close ends at the deadline instead.
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "committed_len 42" in info.value.details()
            assert [r.round for r in replies] == [0]
            # Both sessions go on from where the answered round left them.
            after_a = stub.Verify(pb.VerifyRequest(session_id=a, round=1, committed_len=replies[0].committed_len))
            assert after_a.round == 1
            assert stub.Verify(pb.VerifyRequest(session_id=b, round=0, committed_len=3)).round == 0
            for sid in (a, b):
                stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    finally:
        channel.close()
