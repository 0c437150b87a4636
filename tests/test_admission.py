"""Who gets a call at all: authentication at call start, concurrent-call bounds per identity and per
address, silent streams ended, and anonymous limits kept apart from token limits (cloud/api/admission.py).

The defect: with --credentials, ~1,100 idle VerifyStream calls that never sent a message used up the
front door's concurrent-RPC limit before any token was read (the token was checked on the first
message), so every authenticated edge was refused until they ended.
"""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from hybridspec.cloud.api.access import AccessSpec
from hybridspec.cloud.pool.pool import inprocess_pool
from hybridspec.cloud.api.server import MAX_CONCURRENT_RPCS, BackgroundServer
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.common.security.credentials import add_identity
from hybridspec.common.protocol.proto import verifier_pb2 as pb
from hybridspec.common.protocol.proto import verifier_pb2_grpc as pb_grpc

from conftest import EVENT_TIMEOUT_S

LIMITS = VerifierLimits(max_context=512, max_draft=16, max_sessions=16)
PROMPT = [7, 19, 40, 81]
IDLE_S = 0.5  # stream_idle_s of the test of silent streams


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "credentials.yaml"
    return str(path), {name: add_identity(path, name) for name in ("alice", "mallory")}


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


class IdleStreams:
    """`count` VerifyStream calls that never send a message, held open from an asyncio client on its
    own thread (as a flood from one host would be) until `close`."""

    def __init__(self, address: str, count: int, metadata=()) -> None:
        self.codes: list[grpc.StatusCode | None] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._calls = asyncio.run_coroutine_threadsafe(self._open(address, count, metadata), self._loop).result(60)

    async def _open(self, address, count, metadata):
        # Several connections, as a flood would use: one HTTP/2 connection caps its streams.
        self._channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                          for _ in range(max(1, count // 100))]
        calls = []
        for i in range(count):
            stub = pb_grpc.VerifierStub(self._channels[i % len(self._channels)])
            calls.append(stub.VerifyStream(metadata=metadata or None))
        return calls

    def settled(self, ended: int | None = None) -> list[grpc.StatusCode | None]:
        """Each call's status (None: still open) once `ended` calls have ended (all of them by default);
        fails if they have not within EVENT_TIMEOUT_S. A call the server admitted stays open, so a count
        of refusals says the others were admitted first."""
        want = len(self._calls) if ended is None else ended

        async def codes():
            deadline = self._loop.time() + EVENT_TIMEOUT_S
            while sum(c.done() for c in self._calls) < want:
                assert self._loop.time() < deadline, f"{want} of the calls did not end"
                await asyncio.sleep(0.02)
            return [(await c.code()) if c.done() else None for c in self._calls]

        return asyncio.run_coroutine_threadsafe(codes(), self._loop).result(EVENT_TIMEOUT_S + 30)

    def close(self) -> None:
        async def end():
            for c in self._calls:
                c.cancel()
            for ch in self._channels:
                await ch.close()

        asyncio.run_coroutine_threadsafe(end(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


def victim_round(address: str, token: str = "", timeout_s: float = 10.0) -> None:
    """Open a session, verify one round on a stream and close it (each call fails after `timeout_s`)."""
    metadata = bearer(token) if token else None
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        sid = stub.OpenSession(pb.OpenSessionRequest(committed_ids=PROMPT), metadata=metadata,
                               timeout=timeout_s).session_id
        (reply,) = stub.VerifyStream(iter([pb.VerifyRequest(session_id=sid, round=0, committed_len=len(PROMPT))]),
                                     metadata=metadata, timeout=timeout_s)
        assert reply.committed_len == len(PROMPT) + 1
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=metadata, timeout=timeout_s)


def test_idle_anonymous_streams_cannot_lock_token_holders_out(target, tokens):
    srv = BackgroundServer(Verifier(target, LIMITS), access=AccessSpec(credentials=tokens[0]))
    flood = IdleStreams(srv.address, MAX_CONCURRENT_RPCS + 76)
    try:
        # Each was refused at call start, before it held a slot (a few of a burst this size are
        # reset by gRPC itself, CANCELLED; none is left open).
        codes = flood.settled()
        assert None not in codes and codes.count(grpc.StatusCode.UNAUTHENTICATED) >= 0.99 * len(codes)
        victim_round(srv.address, tokens[1]["alice"])
    finally:
        flood.close()
        srv.stop()


def test_an_identity_holds_at_most_its_calls_and_others_are_served(target, tokens):
    srv = BackgroundServer(Verifier(target, LIMITS), access=AccessSpec(credentials=tokens[0], max_calls_per_client=8))
    flood = IdleStreams(srv.address, 12, bearer(tokens[1]["mallory"]))
    try:
        codes = flood.settled(ended=4)  # refused beyond her 8: so those 8 hold their slots
        assert codes.count(None) == 8 and codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 4
        with grpc.insecure_channel(srv.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.VerifierStub(channel).GetModelInfo(pb.GetModelInfoRequest(),
                                                           metadata=bearer(tokens[1]["mallory"]), timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "mallory" in info.value.details() and "8 calls" in info.value.details()
        victim_round(srv.address, tokens[1]["alice"])
    finally:
        flood.close()
        srv.stop()
    # The slots come back when the calls end: mallory is served again.
    srv = BackgroundServer(Verifier(target, LIMITS), access=AccessSpec(credentials=tokens[0], max_calls_per_client=8))
    try:
        for _ in range(10):
            victim_round(srv.address, tokens[1]["mallory"])
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_stream_that_sends_nothing_is_ended(target):
    srv = BackgroundServer(Verifier(target, LIMITS), access=AccessSpec(stream_idle_s=IDLE_S))
    flood = IdleStreams(srv.address, 3)
    try:
        assert set(flood.settled()) == {grpc.StatusCode.UNAVAILABLE}
        # A stream that keeps sending is not: rounds a fifth of the idle limit apart, for twice as long
        # as the limit in all (the gaps are the input here, not a measurement).
        with grpc.insecure_channel(srv.address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            sid = stub.OpenSession(pb.OpenSessionRequest(committed_ids=PROMPT)).session_id

            def rounds():
                for i in range(10):
                    time.sleep(IDLE_S / 5)
                    yield pb.VerifyRequest(session_id=sid, round=i, committed_len=len(PROMPT) + i)

            assert [r.round for r in stub.VerifyStream(rounds(), timeout=30)] == list(range(10))
    finally:
        flood.close()
        srv.stop()


@pytest.mark.slow
def test_a_stream_waits_idle_only_while_it_waits_for_a_message(target):
    # Every pass outlasts the idle limit, and each next round leaves 0.8 of the limit after its answer:
    # the stream is never idle that long, though its messages are further apart than the limit.
    verifier = Verifier(target, LIMITS)
    forward = verifier.engine.forward

    def slow(feeds):
        time.sleep(IDLE_S * 1.6)
        return forward(feeds)

    verifier.engine.forward = slow
    srv = BackgroundServer(verifier, access=AccessSpec(stream_idle_s=IDLE_S))
    answered = threading.Event()
    try:
        with grpc.insecure_channel(srv.address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            sid = stub.OpenSession(pb.OpenSessionRequest(committed_ids=PROMPT)).session_id

            def rounds():
                for i in range(3):
                    if i:
                        assert answered.wait(EVENT_TIMEOUT_S)
                        answered.clear()
                        time.sleep(IDLE_S * 0.8)
                    yield pb.VerifyRequest(session_id=sid, round=i, committed_len=len(PROMPT) + i)

            got = []
            for reply in stub.VerifyStream(rounds(), timeout=30):
                got.append(reply.round)
                answered.set()
            assert got == [0, 1, 2]
    finally:
        srv.stop()


def test_anonymous_callers_have_their_own_limits_per_address(target, tokens):
    """Without a token every caller of one address is one client: its limits are the address's,
    set apart from the per-token ones."""
    access = AccessSpec(max_calls_per_address=4, max_calls_per_client=100)
    backend = inprocess_pool(Verifier(target, LIMITS), max_sessions_per_client=100, max_sessions_per_address=2)
    srv = BackgroundServer(backend, access=access)
    flood = IdleStreams(srv.address, 6)
    try:
        codes = flood.settled(ended=2)  # refused beyond the address's 4: so those 4 hold their slots
        assert codes.count(None) == 4 and codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 2
    finally:
        flood.close()
    try:
        with grpc.insecure_channel(srv.address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            for _ in range(2):
                stub.OpenSession(pb.OpenSessionRequest(committed_ids=PROMPT))
            with pytest.raises(grpc.RpcError) as info:
                stub.OpenSession(pb.OpenSessionRequest(committed_ids=PROMPT))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "without a token" in info.value.details() and "ipv4:127.0.0.1" in info.value.details()
    finally:
        srv.stop()
