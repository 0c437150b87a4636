"""Malformed and unlucky requests get the documented gRPC status, and the server keeps serving."""
import grpc
import pytest

from hybridspec.cloud.api.server import BackgroundServer
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.common.protocol.proto import verifier_pb2 as pb
from hybridspec.common.protocol.proto import verifier_pb2_grpc as pb_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.VerifierStub(channel)


def open_session(stub, temperature=0.0, ids=(5, 6, 7), session_id=""):
    """Open (or re-open) a session; returns the id the server issued."""
    return stub.OpenSession(pb.OpenSessionRequest(session_id=session_id, committed_ids=list(ids),
                                                  sampling=pb.SamplingParams(temperature=temperature))).session_id


def expect(code, fragment, call, request):
    with pytest.raises(grpc.RpcError) as info:
        call(request)
    assert info.value.code() == code
    assert fragment in info.value.details()


def test_open_session_errors(stub):
    expect(INVALID, "committed_ids", stub.OpenSession, pb.OpenSessionRequest(session_id="s"))
    expect(INVALID, "session_id is 65 characters", stub.OpenSession,
           pb.OpenSessionRequest(session_id="x" * 65, committed_ids=[1]))
    expect(INVALID, "committed_ids[1] = 999", stub.OpenSession,
           pb.OpenSessionRequest(session_id="s", committed_ids=[1, 999]))
    expect(INVALID, "temperature", stub.OpenSession, pb.OpenSessionRequest(
        session_id="s", committed_ids=[1], sampling=pb.SamplingParams(temperature=-1)))
    expect(INVALID, "top_p", stub.OpenSession, pb.OpenSessionRequest(
        session_id="s", committed_ids=[1], sampling=pb.SamplingParams(temperature=1, top_p=2)))
    expect(INVALID, "mode greedy", stub.OpenSession, pb.OpenSessionRequest(
        session_id="s", committed_ids=[1], mode=pb.MODE_GREEDY, sampling=pb.SamplingParams(temperature=1)))
    expect(PRECONDITION, "tokenizer fingerprint", stub.OpenSession, pb.OpenSessionRequest(
        session_id="s", committed_ids=[1], tokenizer_fingerprint="not-the-one"))
    expect(PRECONDITION, "model fingerprint", stub.OpenSession, pb.OpenSessionRequest(
        session_id="s", committed_ids=[1], model_fingerprint="not-the-one"))


def test_a_prompt_past_max_context_is_invalid_argument_naming_both_numbers(stub):
    """A prompt that cannot fit is the request's fault (OpenAI's context_length_exceeded is a 400),
    not the server's state: INVALID_ARGUMENT, before any work (it was RESOURCE_EXHAUSTED)."""
    expect(INVALID, "600 tokens; this verifier's max_context is 512", stub.OpenSession,
           pb.OpenSessionRequest(session_id="long", committed_ids=[5] * 600))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(prompt_ids=[5] * 500, max_new_tokens=20)))
    assert info.value.code() == INVALID
    assert "prompt (500 tokens) plus max_new_tokens (20) exceeds the verifier's max_context of 512" in info.value.details()


def test_verify_errors_name_the_field(stub):
    base = dict(session_id=open_session(stub), round=0, committed_len=3)
    expect(INVALID, "draft_ids[1] = 256", stub.Verify, pb.VerifyRequest(**base, draft_ids=[4, 256]))
    expect(INVALID, "at most 16", stub.Verify, pb.VerifyRequest(**base, draft_ids=[4] * 17))
    expect(INVALID, "draft_probs must be empty", stub.Verify, pb.VerifyRequest(
        **base, draft_ids=[4], draft_probs=[pb.DraftPosition(support_ids=[4], probs=[1.0])]))
    base = dict(session_id=open_session(stub, temperature=1.0), round=0, committed_len=3)
    bad = {
        "positions for 2 draft_ids": [pb.DraftPosition(support_ids=[4], probs=[1.0])],
        "2 support_ids but 1 probs": [pb.DraftPosition(support_ids=[4, 5], probs=[1.0])] * 2,
        "sum to 0.5": [pb.DraftPosition(support_ids=[4, 5], probs=[0.25, 0.25])] * 2,
        "in (0, 1]": [pb.DraftPosition(support_ids=[4, 5], probs=[1.5, -0.5])] * 2,
        "repeated ids": [pb.DraftPosition(support_ids=[4, 4], probs=[0.5, 0.5])] * 2,
        "does not contain the draft token 4": [pb.DraftPosition(support_ids=[5, 6], probs=[0.5, 0.5])] * 2,
        "support_ids[1] = 300": [pb.DraftPosition(support_ids=[4, 300], probs=[0.5, 0.5])] * 2,
    }
    for fragment, positions in bad.items():
        expect(INVALID, fragment, stub.Verify, pb.VerifyRequest(**base, draft_ids=[4, 4], draft_probs=positions))


def test_session_state_errors(stub):
    expect(PRECONDITION, "unknown", stub.Verify, pb.VerifyRequest(session_id="nobody", round=0, committed_len=1))
    sid = open_session(stub)
    expect(PRECONDITION, "round 3", stub.Verify, pb.VerifyRequest(session_id=sid, round=3, committed_len=3))
    expect(PRECONDITION, "committed_len 9", stub.Verify, pb.VerifyRequest(session_id=sid, round=0, committed_len=9))


def test_replayed_round_is_idempotent(stub):
    sid = open_session(stub)
    first = stub.Verify(pb.VerifyRequest(session_id=sid, round=0, committed_len=3, draft_ids=[9, 9]))
    again = stub.Verify(pb.VerifyRequest(session_id=sid, round=0, committed_len=3, draft_ids=[9, 9]))
    assert (again.num_accepted, again.next_token, again.committed_len) == \
        (first.num_accepted, first.next_token, first.committed_len)
    nxt = stub.Verify(pb.VerifyRequest(session_id=sid, round=1, committed_len=first.committed_len))
    assert nxt.committed_len == first.committed_len + 1


def test_stream_error_ends_only_that_stream(stub):
    sid = open_session(stub)
    replies = stub.VerifyStream(iter([pb.VerifyRequest(session_id=sid, round=0, committed_len=3),
                                      pb.VerifyRequest(session_id=sid, round=5, committed_len=4)]))
    first = next(replies)
    assert first.committed_len == 4
    with pytest.raises(grpc.RpcError) as info:
        next(replies)
    assert info.value.code() == PRECONDITION
    assert stub.GetModelInfo(pb.GetModelInfoRequest()).vocab_size == 256  # still serving


def test_too_many_sessions_is_resource_exhausted(target):
    small = BackgroundServer(Verifier(target, VerifierLimits(max_sessions=2)))
    try:
        with grpc.insecure_channel(small.address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            a = open_session(stub)
            open_session(stub)
            assert open_session(stub, session_id=a) == a  # re-opening a live session needs no new slot
            expect(grpc.StatusCode.RESOURCE_EXHAUSTED, "2 sessions", stub.OpenSession,
                   pb.OpenSessionRequest(committed_ids=[1]))
            assert stub.CloseSession(pb.CloseSessionRequest(session_id=a)).existed
            open_session(stub)  # room again
    finally:
        small.stop()


def test_health_and_reflection_are_served(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="hybridspec.v1.Verifier")).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in next(replies).list_services_response.service}
        assert "hybridspec.v1.Verifier" in names
