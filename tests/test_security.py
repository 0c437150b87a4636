"""The verifier pool on the internet: TLS (and mutual TLS) with throw-away certificates from trustme,
per-edge tokens, session ownership and per-identity limits — over real gRPC on localhost, with the
in-process backend and with a real Ray pool whose replicas take rounds on their own endpoints."""
from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridspec.cloud.api.access import AccessSpec
from hybridspec.cloud.pool.pool import inprocess_pool
from hybridspec.cloud.pool.ray_pool import RayPool
from hybridspec.cloud.pool.specs import PoolSettings, PoolSpec, ReplicaSettings, ReplicaSpec
from hybridspec.cloud.api.server import BackgroundServer, ReplicaEndpoint
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.common.config import ConfigError
from hybridspec.common.security.credentials import add_identity, remove_identity
from hybridspec.common.protocol.errors import Unauthenticated, Unavailable
from hybridspec.common.protocol.proto import verifier_pb2 as pb
from hybridspec.common.protocol.proto import verifier_pb2_grpc as pb_grpc
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec
from hybridspec.common.security.tls import ClientTLS
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import CloudAccess, EdgeConfig
from hybridspec.edge.worker import EdgeWorker

from conftest import UNLOADABLE, eventually
from test_cli import ENV
from tinymodels import EVERY_ROUND, greedy_reference

PROMPT = [7, 19, 40, 81]
NEW_TOKENS = 12
SERVER_NAME = "verifier.hybridspec.test"
LIMITS = VerifierLimits(max_context=512, max_draft=16, max_sessions=16)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA and the server's certificate (for the test name and 127.0.0.1), a second unrelated CA, and a
    client CA with one edge's certificate, all as PEM files."""
    root = tmp_path_factory.mktemp("pki")
    ca, other, client_ca = trustme.CA(), trustme.CA(), trustme.CA()
    server = ca.issue_cert(SERVER_NAME, "127.0.0.1")
    edge = client_ca.issue_cert("edge-1")
    files = {"ca": ca.cert_pem, "other_ca": other.cert_pem, "client_ca": client_ca.cert_pem,
             "cert": server.cert_chain_pems[0], "key": server.private_key_pem,
             "edge_cert": edge.cert_chain_pems[0], "edge_key": edge.private_key_pem}
    paths = {}
    for name, blob in files.items():
        blob.write_to_path(str(root / f"{name}.pem"))
        paths[name] = str(root / f"{name}.pem")
    paths["issuer"] = ca
    return paths


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """A credentials file: alice and bob with the server's defaults, `slow` with a tiny rate, `small`
    with one session; returns (path, {name: token})."""
    path = tmp_path_factory.mktemp("auth") / "credentials.yaml"
    issued = {name: add_identity(path, name) for name in ("alice", "bob")}
    issued["slow"] = add_identity(path, "slow", tokens_per_s=10)
    issued["small"] = add_identity(path, "small", max_sessions=1)
    return str(path), issued


def access(pki, tokens, mutual=False) -> AccessSpec:
    return AccessSpec(tls_cert=pki["cert"], tls_key=pki["key"], tls_client_ca=pki["client_ca"] if mutual else "",
                      credentials=tokens[0])


def edge_access(pki, token, ca="ca", **tls) -> CloudAccess:
    return CloudAccess(ClientTLS(enabled=True, ca=pki[ca], server_name=SERVER_NAME, **tls), token)


@pytest.fixture(scope="module")
def secure_server(target, pki, tokens):
    """A front door with TLS and tokens, in front of one in-process verifier."""
    srv = BackgroundServer(inprocess_pool(Verifier(target, LIMITS), max_sessions_per_client=4),
                           access=access(pki, tokens))
    yield srv
    srv.stop()


def edge_config(address: str) -> EdgeConfig:
    return EdgeConfig.of(cloud=address, max_new_tokens=NEW_TOKENS, max_draft=3, fallback_threshold=0.0, **EVERY_ROUND)


def generate(address: str, cloud_access: CloudAccess, drafter) -> list[int]:
    with VerifierClient(address, access=cloud_access) as client:
        return EdgeWorker(drafter, client, edge_config(address)).generate(PROMPT).token_ids


def secure_stub(address: str, pki, ca="ca", **tls):
    credentials = ClientTLS(enabled=True, ca=pki[ca], **tls).channel_credentials()
    channel = grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", SERVER_NAME)])
    return channel, pb_grpc.VerifierStub(channel)


def auth(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


def code_of(call, *args, **kwargs):
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value.code(), info.value.details()


# ---- TLS -------------------------------------------------------------------------------------------

def test_greedy_output_is_identical_over_tls_with_a_token(secure_server, pki, tokens, target, random_drafter):
    expected = greedy_reference(target, PROMPT, NEW_TOKENS)
    for drafter in (target, random_drafter):  # every draft accepted / nearly every draft rejected
        assert generate(secure_server.address, edge_access(pki, tokens[1]["alice"]), drafter) == expected


def test_a_server_certificate_from_another_ca_is_refused(secure_server, pki, tokens, target):
    with pytest.raises(Unavailable, match="not signed by a trusted CA"):
        generate(secure_server.address, edge_access(pki, tokens[1]["alice"], ca="other_ca"), target)


def test_a_wrong_server_name_and_a_plaintext_client_are_refused(secure_server, pki, tokens, target):
    wrong_name = CloudAccess(ClientTLS(enabled=True, ca=pki["ca"], server_name="elsewhere.test"), tokens[1]["alice"])
    with pytest.raises(Unavailable, match="does not name that host"):
        generate(secure_server.address, wrong_name, target)
    with pytest.raises(Unavailable):
        generate(secure_server.address, CloudAccess(token=tokens[1]["alice"]), target)


def test_mutual_tls_needs_a_client_certificate_from_the_client_ca(target, pki, tokens):
    srv = BackgroundServer(inprocess_pool(Verifier(target, LIMITS)), access=access(pki, tokens, mutual=True))
    try:
        token = tokens[1]["alice"]
        with pytest.raises(Unavailable):
            generate(srv.address, edge_access(pki, token), target)
        with_cert = edge_access(pki, token, cert=pki["edge_cert"], key=pki["edge_key"])
        assert generate(srv.address, with_cert, target) == greedy_reference(target, PROMPT, NEW_TOKENS)
    finally:
        srv.stop()


def test_a_rotated_certificate_is_served_without_a_restart(target, pki, tokens, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    shutil.copy(pki["cert"], cert)
    shutil.copy(pki["key"], key)
    spec = AccessSpec(tls_cert=str(cert), tls_key=str(key), credentials=tokens[0])
    srv = BackgroundServer(inprocess_pool(Verifier(target, LIMITS)), access=spec)
    try:
        new_ca = trustme.CA()
        renewed = new_ca.issue_cert(SERVER_NAME, "127.0.0.1")
        renewed.private_key_pem.write_to_path(str(key))
        renewed.cert_chain_pems[0].write_to_path(str(cert))
        new_ca.cert_pem.write_to_path(str(tmp_path / "new-ca.pem"))
        pki_now = {**pki, "new_ca": str(tmp_path / "new-ca.pem")}
        token = tokens[1]["alice"]
        assert generate(srv.address, edge_access(pki_now, token, ca="new_ca"), target)
        with pytest.raises(Unavailable, match="not signed by a trusted CA"):
            generate(srv.address, edge_access(pki_now, token, ca="ca"), target)
    finally:
        srv.stop()


# ---- tokens ----------------------------------------------------------------------------------------

def test_no_or_a_wrong_token_is_unauthenticated_and_health_stays_open(secure_server, pki):
    channel, stub = secure_stub(secure_server.address, pki)
    with channel:
        request = pb.OpenSessionRequest(committed_ids=[5, 6])
        for metadata in ((), auth("hs_not-a-token"), (("authorization", "Basic YWxpY2U6eA=="),)):
            code, details = code_of(stub.OpenSession, request, metadata=metadata)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (metadata, code)
            assert "hs_not-a-token" not in details
        assert code_of(stub.GetModelInfo, pb.GetModelInfoRequest())[0] == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_the_edge_reports_a_refused_token_in_one_line(secure_server, pki, target):
    with pytest.raises(Unauthenticated, match="refused this edge's credentials: invalid credentials"):
        generate(secure_server.address, edge_access(pki, "hs_revoked-or-made-up"), target)


@pytest.mark.parametrize("flags, message", [
    (["--tls-ca", "other_ca"], "not signed by a trusted CA"),
    (["--tls-ca", "ca", "--tls-server-name", "wrong.example"], "does not name that host"),
])
def test_the_edge_cli_reports_a_refused_handshake_in_exactly_one_line(secure_server, pki, model_dirs, flags, message):
    """gRPC's C core logs every failed handshake on stderr unless told otherwise; the CLI's one
    error line must be all a user sees."""
    flags = [pki.get(flag, flag) for flag in flags]
    if "--tls-server-name" not in flags:
        flags += ["--tls-server-name", SERVER_NAME]
    result = subprocess.run([sys.executable, "-m", "hybridspec.cli.main", "edge", "generate", "--prompt", "w5 w6",
                             "--cloud", secure_server.address, "--drafter", str(model_dirs["target"]),
                             "--max-new-tokens", "4", "--tls", *flags], capture_output=True, text=True,
                            timeout=120, env=ENV)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridspec: error:") and message in lines[0], result.stderr


def test_another_identitys_session_is_permission_denied_and_left_intact(secure_server, pki, tokens, target):
    alice, bob = auth(tokens[1]["alice"]), auth(tokens[1]["bob"])
    channel, stub = secure_stub(secure_server.address, pki)
    with channel:
        sid = stub.OpenSession(pb.OpenSessionRequest(committed_ids=PROMPT), metadata=alice).session_id
        round0 = pb.VerifyRequest(session_id=sid, round=0, committed_len=len(PROMPT), draft_ids=[5])
        attacks = [(stub.Verify, round0), (stub.CloseSession, pb.CloseSessionRequest(session_id=sid)),
                   (stub.OpenSession, pb.OpenSessionRequest(session_id=sid, committed_ids=[9, 9, 9]))]
        for call, request in attacks:
            code, details = code_of(call, request, metadata=bob)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "another identity" in details, call
        reply = stub.Verify(round0, metadata=alice)  # alice's session is as she left it
        assert reply.committed_len == len(PROMPT) + 1 + reply.num_accepted
        assert ([5] if reply.num_accepted else []) + [reply.next_token] == \
            greedy_reference(target, PROMPT, reply.num_accepted + 1)
        assert stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=alice).existed


def test_over_its_limits_an_identity_gets_resource_exhausted(secure_server, pki, tokens):
    channel, stub = secure_stub(secure_server.address, pki)
    with channel:
        # `slow` may prefill 10 tokens/s with 2 s of credit and 2 s of waiting: 100 tokens is too many.
        code, details = code_of(stub.OpenSession, pb.OpenSessionRequest(committed_ids=[5] * 100),
                                metadata=auth(tokens[1]["slow"]))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "slow is over its limit of 10 tokens/s" in details
        # `small` may hold one session; others keep the server's limit of 4.
        small = auth(tokens[1]["small"])
        first = stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5]), metadata=small).session_id
        code, details = code_of(stub.OpenSession, pb.OpenSessionRequest(committed_ids=[5]), metadata=small)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "the limit is 1" in details
        stub.CloseSession(pb.CloseSessionRequest(session_id=first), metadata=small)


def test_a_paced_identity_is_slowed_not_refused(secure_server, pki, tokens, monkeypatch):
    """Within its credit plus the longest wait, a request over the rate is delayed, not failed: the front
    door waits what the rate limiter says before it answers. The limiter's clock stands still here, so
    the delays are its whole answer (not what this machine's load left of them), and the front door's
    waits are recorded instead of slept."""
    from hybridspec.cloud.api import access as access_module
    from hybridspec.cloud.api import service as service_module

    now = time.monotonic()
    monkeypatch.setattr(access_module, "time", SimpleNamespace(monotonic=lambda: now))
    waits = []

    class RecordedWaits:
        """The service module's asyncio, but for `sleep`, which records the wait and returns."""

        def __getattr__(self, name):
            return getattr(asyncio, name)

        @staticmethod
        async def sleep(seconds: float) -> None:
            waits.append(seconds)

    monkeypatch.setattr(service_module, "asyncio", RecordedWaits())
    channel, stub = secure_stub(secure_server.address, pki)
    slow = auth(tokens[1]["slow"])
    with channel:
        for i in range(3):  # 3 x 12 tokens at 10 tokens/s with 20 tokens of credit: the second waits 0.4 s, the third 1.6
            sid = stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5] * 12), metadata=slow).session_id
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=slow)
            assert len(waits) == i  # each open waited before it was answered
    assert waits == [pytest.approx(0.4), pytest.approx(1.6)]


def test_a_revoked_token_stops_working_without_a_restart(target, pki, tmp_path, caplog):
    path = tmp_path / "credentials.yaml"
    token = add_identity(path, "temp")
    srv = BackgroundServer(inprocess_pool(Verifier(target, LIMITS)),
                           access=AccessSpec(tls_cert=pki["cert"], tls_key=pki["key"], credentials=str(path)))
    channel, stub = secure_stub(srv.address, pki)
    try:
        with channel:
            stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=auth(token))
            assert remove_identity(path, "temp")

            def refused() -> bool:
                try:
                    stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=auth(token))
                    return False
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
                    return True

            eventually(refused, "the revoked token refused")
            path.write_text("identities: [not, a, mapping]\n")  # a broken file keeps the last good table

            def refused_until_read() -> bool:
                """Refused on every try, until the server has read the broken file (it logs that it
                keeps the table it had)."""
                assert refused(), "the revoked token works again"
                return any("keeping the" in r.getMessage() for r in caplog.records)

            eventually(refused_until_read, "the broken credentials file read")
            assert refused(), "the revoked token works again after a broken credentials file"
    finally:
        srv.stop()


# ---- a Ray pool: replica endpoints speak TLS and check tokens too ------------------------------------

@pytest.fixture(scope="module")
def secure_pool(ray_cluster, model_dirs, pki, tokens):
    spec = access(pki, tokens)
    replica = ReplicaSpec(str(model_dirs["target"]), ReplicaSettings(device="cpu", torch_threads=1), LIMITS)
    pool = RayPool(PoolSpec(replica, PoolSettings(replicas=1, replica_num_cpus=0.5), name="secure-pool"),
                   ReplicaEndpoint("127.0.0.1", spec))
    server = BackgroundServer(pool, access=spec)
    yield server, pool
    server.stop()


@pytest.mark.slow
def test_direct_rounds_use_tls_and_tokens_and_stay_exact(secure_pool, pki, tokens, target, random_drafter):
    server, pool = secure_pool
    endpoint = next(iter(pool.replicas.values())).verify_address
    with VerifierClient(server.address, access=edge_access(pki, tokens[1]["alice"])) as client:
        for drafter in (target, random_drafter):
            gen = EdgeWorker(drafter, client, edge_config(server.address)).generate(PROMPT)
            assert gen.token_ids == greedy_reference(target, PROMPT, NEW_TOKENS)
            assert client.rounds_address == endpoint  # the rounds went to the replica, over TLS
    # The replica's own endpoint: plaintext refused; no token, another's session -> their statuses.
    with grpc.insecure_channel(endpoint) as plain:
        assert code_of(_stream_once, plain, "any-session", ())[0] == grpc.StatusCode.UNAVAILABLE
    alice, bob = auth(tokens[1]["alice"]), auth(tokens[1]["bob"])
    front, stub = secure_stub(server.address, pki)
    with front:
        opened = stub.OpenSession(pb.OpenSessionRequest(committed_ids=PROMPT), metadata=alice)
        assert opened.verify_address == endpoint
        channel, _ = secure_stub(endpoint, pki)
        with channel:
            assert code_of(_stream_once, channel, opened.session_id, ())[0] == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(_stream_once, channel, opened.session_id, bob)[0] == grpc.StatusCode.PERMISSION_DENIED
            reply = _stream_once(channel, opened.session_id, alice)
            assert reply.committed_len == len(PROMPT) + 1
        stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), metadata=alice)


def test_with_one_replica_an_identitys_rate_is_its_rate(secure_pool, pki, tokens):
    """`slow` may do 10 tokens/s (2 s of credit). It opens a 39-token prompt through the front door and
    sends four 17-token rounds to the replica's own endpoint: 107 tokens, which at its rate take at
    least (107 - 20) / 10 = 8.7 s. The front door and the endpoint used to keep a bucket each, and the
    same work took about 1.9 + (68 - 20) / 10 = 6.7 s (a 2x rate was measured that way); now the
    replica charges the open to its endpoint's bucket and the front door charges nothing."""
    server, pool = secure_pool
    with VerifierClient(server.address, timeout_s=60, access=edge_access(pki, tokens[1]["slow"])) as client:
        started = time.perf_counter()
        opened = client.open_session(SessionSpec("", tuple(range(5, 44))))
        assert client.rounds_address == next(iter(pool.replicas.values())).verify_address
        committed = opened.committed_len
        for r in range(4):
            committed = client.verify(DraftBlock(opened.session_id, r, committed, tuple(range(20, 36)))).committed_len
        took = time.perf_counter() - started
        client.close_session(opened.session_id)
    assert took >= 8.0, took


def _stream_once(channel, session_id: str, metadata):
    """One round of `session_id` on a VerifyStream (the only RPC a replica endpoint serves)."""
    stub = pb_grpc.VerifierStub(channel)
    request = pb.VerifyRequest(session_id=session_id, round=0, committed_len=len(PROMPT), draft_ids=[5])
    return next(iter(stub.VerifyStream(iter([request]), metadata=metadata, timeout=30)))


# ---- configuration: one clear line ---------------------------------------------------------------

def test_plaintext_beyond_loopback_needs_insecure():
    from hybridspec.cloud.config import ServeConfig

    with pytest.raises(ConfigError, match="would listen on 0.0.0.0 without TLS"):
        ServeConfig.of(host="0.0.0.0")
    assert ServeConfig.of(host="0.0.0.0", insecure=True).server.host == "0.0.0.0"
    assert ServeConfig.of(host="0.0.0.0", tls_cert="c.pem", tls_key="k.pem").access.tls.enabled
    with pytest.raises(ConfigError, match="go together"):
        ServeConfig.of(tls_cert="c.pem")


def test_an_edge_sends_its_token_in_plaintext_only_to_loopback_or_when_told(monkeypatch):
    monkeypatch.setenv("HYBRIDSPEC_TOKEN", "hs_test")
    with pytest.raises(ConfigError, match="in plaintext"):
        EdgeConfig.of(cloud="203.0.113.7:50051").cloud_access()
    assert EdgeConfig.of(cloud="127.0.0.1:50051").cloud_access().token == "hs_test"
    assert EdgeConfig.of(cloud="203.0.113.7:50051", insecure=True).cloud_access().token == "hs_test"
    assert EdgeConfig.of(cloud="203.0.113.7:50051", tls=True).cloud_access().tls.enabled
    monkeypatch.delenv("HYBRIDSPEC_TOKEN")
    assert EdgeConfig.of(cloud="203.0.113.7:50051").cloud_access().token is None  # no token: nothing to leak


@pytest.mark.parametrize("flags, message", [
    (["--host", "0.0.0.0"], "would listen on 0.0.0.0 without TLS"),
    (["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"],
     "tls_key /nonexistent/key.pem cannot be read"),
    (["--credentials", "/nonexistent/credentials.yaml"], "credentials file /nonexistent/credentials.yaml cannot be read"),
])
def test_cloud_serve_refuses_a_bad_security_setup_in_one_line(flags, message):
    """Before anything slow starts: the target given cannot be loaded, so a check made after the model
    loads would fail on the target instead."""
    result = subprocess.run([sys.executable, "-m", "hybridspec.cli.main", "cloud", "serve", "--target", UNLOADABLE,
                             "--backend", "inprocess", "--port", "0", "--metrics-port", "-1", *flags],
                            capture_output=True, text=True, timeout=60, env=ENV)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if "hybridspec: error:" in line]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_a_token_file_is_read_and_checked(tmp_path):
    path = tmp_path / "token"
    path.write_text("hs_abc\n")
    assert EdgeConfig.of(token_file=str(path)).cloud_access().token == "hs_abc"
    path.write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        EdgeConfig.of(token_file=str(path)).cloud_access()
    with pytest.raises(ConfigError, match="cannot be read"):
        EdgeConfig.of(token_file=str(tmp_path / "missing")).cloud_access()
