"""Many tenants on one pool, through the front door (issue 56): two identities from a credentials file
on a real gRPC server in front of one verifier on a tiny target. One identity's many sessions neither
take the other's turn in the passes nor evict its idle conversation. (tests/test_fair_share.py tests
the planner's rules alone.)"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

from conftest import started
from hybridspec.cloud.api.access import AccessSpec
from hybridspec.cloud.api.server import BackgroundServer
from hybridspec.cloud.core.limits import PrefixScope
from hybridspec.cloud.core.verifier import ACTIVE_WINDOW_S, Verifier, VerifierLimits
from hybridspec.cloud.pool.pool import inprocess_pool
from hybridspec.common.protocol.errors import FailedPrecondition
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec
from hybridspec.common.security.credentials import add_identity, read_credentials
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import CloudAccess

from test_cli import ENV

LIMITS = VerifierLimits(max_context=256, max_draft=8, max_sessions=32, prefix_scope=PrefixScope.OFF)
PROMPT = tuple(range(10, 30))  # 20 tokens


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "credentials.yaml"
    return str(path), {name: add_identity(path, name) for name in ("alice", "bob")}


def client(server: BackgroundServer, token: str | None) -> VerifierClient:
    return VerifierClient(server.address, access=CloudAccess(token=token))


def until(condition, timeout_s: float = 30.0) -> None:
    """Wait for `condition()` (an event another thread brings about), failing after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_an_honest_round_shares_the_next_pass_with_another_identitys_many(target, tokens):
    """Bob's eight sessions have a round queued each when alice sends hers, and a pass carries four: by
    arrival, alice's round waited for bob's eight to be scored (the third pass); by share it runs in the
    very next pass, next to bob's. (Both start level: their opens are past the activity window, and
    what a tenant used while the other was idle is not held against it.)"""
    verifier = Verifier(target, LIMITS, max_batch=4, max_wait_ms=0)
    server = BackgroundServer(inprocess_pool(verifier), access=AccessSpec(credentials=tokens[0]))
    passes_fed: list[set[int]] = []
    forward = verifier.engine.forward
    verifier.engine.forward = lambda feeds: passes_fed.append({id(f.kv) for f in feeds}) or forward(feeds)
    clients = [client(server, tokens[1]["bob"]) for _ in range(8)] + [client(server, tokens[1]["alice"])]
    try:
        ids = [c.open_session(SessionSpec("", PROMPT)).session_id for c in clients]
        kv = {s.spec.session_id: id(s.kv) for s in verifier._sessions.live()}
        time.sleep(ACTIVE_WINDOW_S + 0.1)  # the opens' time is forgotten once their tenants are inactive
        passes_fed.clear()
        gate = threading.Event()
        hold = verifier.submit_call(lambda: gate.wait(60))  # the model thread is held while the rounds queue
        rounds = [c.submit(DraftBlock(sid, 0, len(PROMPT), (5, 6))) for c, sid in zip(clients[:8], ids)]
        until(lambda: len(verifier._rounds) == 8)
        rounds.append(clients[8].submit(DraftBlock(ids[8], 0, len(PROMPT), (5, 6))))
        until(lambda: len(verifier._rounds) == 9)
        gate.set()
        hold.result(30)
        for c, r in zip(clients, rounds):
            c.wait(r)
        assert kv[ids[8]] in passes_fed[0], [sorted(p) for p in passes_fed]
        assert any(kv[sid] in passes_fed[0] for sid in ids[:8])
    finally:
        for c in clients:
            c.close()
        server.stop()


def test_another_identity_over_its_share_cannot_evict_an_honest_idle_conversation(target, tokens):
    """A cache of 128 tokens (eight pages of 16): alice's conversation is opened first and left idle;
    bob opens six sessions of 20 tokens one after the other. Least recently used first, alice's was the
    first evicted; by share bob (over half the cache) gives up his own oldest, and alice's next round is
    answered."""
    verifier = Verifier(target, replace(LIMITS, kv_cache_tokens=128))
    server = BackgroundServer(inprocess_pool(verifier), access=AccessSpec(credentials=tokens[0]))
    alice, bob = client(server, tokens[1]["alice"]), client(server, tokens[1]["bob"])
    try:
        mine = alice.open_session(SessionSpec("", PROMPT)).session_id
        theirs = [bob.open_session(SessionSpec("", PROMPT)).session_id for _ in range(6)]
        assert alice.verify(DraftBlock(mine, 0, len(PROMPT), (5,))).round == 0
        with pytest.raises(FailedPrecondition, match="evicted"):
            bob.verify(DraftBlock(theirs[0], 0, len(PROMPT), (5,)))
    finally:
        alice.close()
        bob.close()
        server.stop()


def test_weights_are_issued_listed_and_old_files_load(tmp_path):
    """`token add --weight` writes an identity's share weight, `token list` shows it, a file written
    before weights existed loads with weight 1, and a bad weight is one line."""
    path = tmp_path / "credentials.yaml"

    def run(*args):
        return subprocess.run([sys.executable, "-m", "hybridspec.cli.main", "token", *args, "--file", str(path)],
                              capture_output=True, text=True, env=ENV, timeout=60)

    assert run("add", "batch").returncode == 0
    assert run("add", "interactive", "--weight", "3").returncode == 0
    assert read_credentials(path)  # an entry without a weight (batch) and one with
    weights = {i.name: i.weight for i in read_credentials(path).values()}
    assert weights == {"batch": 1.0, "interactive": 3.0}
    assert run("list").stdout.splitlines() == ["batch", "interactive weight=3"]
    bad = run("add", "x", "--weight", "0")
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1 and "weight" in bad.stderr


def test_a_full_replica_says_the_prompts_size_its_state_and_when_to_retry(target):
    """A prompt that cannot get room used to be refused with the engine's words ("the KV cache is full");
    the refusal names the prompt's size, what the replica holds and carries a RetryInfo (gRPC status
    details) that the edge client reads."""
    import grpc
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    from hybridspec.common.protocol.errors import ResourceExhausted
    from hybridspec.common.protocol.proto import verifier_pb2 as pb
    from hybridspec.common.protocol.proto import verifier_pb2_grpc as pb_grpc

    verifier = Verifier(target, replace(LIMITS, kv_cache_tokens=64))  # four pages: 100 tokens never fit here
    server = BackgroundServer(inprocess_pool(verifier))
    prompt = tuple(range(10, 110))
    try:
        with client(server, None) as edge:
            edge.open_session(SessionSpec("", PROMPT))  # idle: evicted for the next one, which still cannot fit
            with pytest.raises(ResourceExhausted) as refused:
                edge.open_session(SessionSpec("", prompt))
        text = str(refused.value)
        assert "100-token prompt" in text and "holds 0 sessions" in text and "of its 64 KV tokens" in text
        assert "retry in about 5 s" in text and refused.value.retry_after_s == 5.0
        channel = grpc.insecure_channel(server.address)
        with pytest.raises(grpc.RpcError) as raw:
            pb_grpc.VerifierStub(channel).OpenSession(pb.OpenSessionRequest(committed_ids=prompt), timeout=30)
        channel.close()
        info = error_details_pb2.RetryInfo()
        assert rpc_status.from_call(raw.value).details[0].Unpack(info) and info.retry_delay.seconds == 5
    finally:
        server.stop()
