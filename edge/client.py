"""gRPC client for the verifier: wire dataclasses in and out, gRPC errors as domain errors.

Verification rounds travel on one bidirectional stream per session. `submit` sends a round and
returns at once with a handle whose reply a reader thread fills in, so the edge can keep drafting
while the round is verified (pipelining); `verify` waits for it. A failed stream is replaced on the
next round. Uplink/downlink counters hold serialized message bytes (no HTTP/2 framing).

Every call carries the edge's bearer token when it has one, and every channel speaks TLS when the
config asks for it; a replica's endpoint presents the front door's certificate, so its name is checked
against the front door's (or `tls_server_name`), not against the replica's address.

An open reports its progress while the cloud caches the prompt (`OpenSessionStream`: a message at
least every 2 s), so a silent cloud is found after `timeout_s` without a word, not after a deadline
scaled to the prompt; a server without it is asked with the unary `OpenSession`.

Everything but the rounds and cloud-only `Decode` streams goes to the front door. Those go where the
last OpenSession said: straight to the replica that holds the session when the reply names its
endpoint (a second channel), else to the front door. When that endpoint stops answering, the round
(or stream) fails with ReplicaUnreachable
(a FailedPrecondition: re-open at the front door, which knows where the session lives now), and the
endpoint is avoided for a while, so an edge that cannot reach replicas directly still gets served.
"""
from __future__ import annotations

import collections
import queue
from collections.abc import Iterator
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from ..common.protocol import codec
from ..common.protocol.channel import SHARED_OPTIONS
from ..common.protocol.errors import FailedPrecondition, HybridSpecError, Unavailable, error_for_code
from ..common.protocol.proto import verifier_pb2 as pb
from ..common.protocol.proto import verifier_pb2_grpc as pb_grpc
from ..common.protocol.wire import (PROGRESS_EVERY_S, DecodeSpec, DraftBlock, GenerateSpec, ModelInfo, OpenProgress,
                                    SessionOpened, SessionSpec, VerifyResult)
from .config import DEFAULT_TIMEOUT_S, CloudAccess

CHANNEL_OPTIONS = [
    *SHARED_OPTIONS,
    # After an outage, reconnect within a second or two rather than gRPC's default of up to 2 min.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
_END = object()
AVOID_UNREACHABLE_S = 60.0  # a replica endpoint that failed is not dialled again for this long
# How long closing a client waits for the session closes it sent without waiting: a close is a soft
# cache release (the verifier expires idle sessions itself), so a dead link must not hold an exit up.
CLOSE_FLUSH_S = 1.0
# A call's deadline adds the work it asks for to the timeout. A prompt is prefilled at 10 tokens/s at
# the least (the embedded target on one CPU core: about 46/s at 2,300 tokens, where attention over the
# long cache dominates), a cloud-only token comes within a second.
PREFILL_S_PER_TOKEN = 0.1
DECODE_S_PER_TOKEN = 1.0
# An open that reports its progress is given up after the client's timeout without a message, but never
# sooner than this many of the server's longest promised gaps (a short timeout is for rounds).
OPEN_SILENT_GAPS = 3


class ReplicaUnreachable(FailedPrecondition):
    """The replica endpoint a session's rounds went to stopped answering: re-open at the front door."""


class _Endpoint:
    """A channel and its stub."""

    def __init__(self, address: str, access: CloudAccess, server_name: str) -> None:
        """server_name: the name the endpoint's certificate must carry ("" = the host in `address`)."""
        self.address = address
        tls = access.tls
        if tls.enabled:
            options = [*CHANNEL_OPTIONS, *([("grpc.ssl_target_name_override", server_name)] if server_name else [])]
            self.channel = grpc.secure_channel(address, tls.channel_credentials(), options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.VerifierStub(self.channel)


@dataclass
class PendingRound:
    """A round in flight: the block sent, and when; its reply arrives in `future`, and `arrived` is set
    when it does. Reading it changes nothing (`VerifierClient.wait` reads the reply)."""

    block: DraftBlock
    sent: float
    future: Future = field(default_factory=Future)
    arrived: float = 0.0

    def done(self) -> bool:
        """True once the reply (or an error) is in."""
        return self.future.done()


class Opening:
    """An OpenSession in flight: `updates` yields how far the cloud has got as it reports it and ends once
    the reply is in, which `result` (or calling it) returns. No word for the client's timeout (at least
    OPEN_SILENT_GAPS of the server's promised gaps) is an outage (Unavailable, the call cancelled),
    however long the prompt."""

    def __init__(self, client: VerifierClient, spec: SessionSpec) -> None:
        self._client, self._spec = client, spec
        self._request = codec.session_to_pb(spec)
        self._messages: queue.Queue = queue.Queue()
        self._opened: SessionOpened | None = None
        client._count(up=self._request.ByteSize())
        self._call = self._start(client._streamed_opens)

    def __call__(self) -> SessionOpened:
        return self.result()

    def result(self) -> SessionOpened:
        """The reply (the session id every later call carries, its length), once it is in."""
        for _ in self.updates():
            pass
        return self._opened

    def updates(self) -> Iterator[OpenProgress]:
        """How far the open has got, as the cloud reports it (nothing from a server that does not);
        returns once the reply is in; raises the open's domain error, or Unavailable after the client's
        timeout without a message."""
        client = self._client
        silent_s = max(client.timeout_s, OPEN_SILENT_GAPS * PROGRESS_EVERY_S)
        while self._opened is None:
            try:
                item = self._messages.get(timeout=silent_s if self._call is not None else None)
            except queue.Empty:
                self._call.cancel()
                raise Unavailable(f"cloud verifier at {client.address} sent nothing for {silent_s:g} s "
                                  "while it had the prompt") from None
            if isinstance(item, grpc.RpcError):
                if item.code() is grpc.StatusCode.UNIMPLEMENTED and client._streamed_opens:
                    client._streamed_opens = False  # a server from before OpenSessionStream: ask it as before
                    self._call = self._start(False)
                    continue
                raise _domain_error(item, client.address) from None
            if isinstance(item, OpenProgress):
                yield item
                continue
            self._opened = item
            client._route(item.verify_address)

    def _start(self, streamed: bool):
        """Send the request; a thread hands every message (or the error) to `updates`."""
        client = self._client
        deadline = client._deadline(prompt=len(self._spec.committed_ids))
        if streamed:
            call = client._front.stub.OpenSessionStream(self._request, timeout=deadline, metadata=client.metadata)
        else:
            call = client._front.stub.OpenSession.future(self._request, timeout=deadline, metadata=client.metadata)
        threading.Thread(target=self._read, args=(call, streamed), daemon=True, name="open-session").start()
        return call if streamed else None  # a unary call has no stall to watch: its deadline is the bound

    def _read(self, call, streamed: bool) -> None:
        try:
            if streamed:
                for message in call:
                    self._client._count(down=message.ByteSize())
                    self._messages.put(codec.progress_from_pb(message))
            else:
                message = call.result()
                self._client._count(down=message.ByteSize())
                self._messages.put(codec.opened_from_pb(message))
        except grpc.RpcError as exc:
            self._messages.put(exc)


class _Stream:
    """One VerifyStream call: a request queue, the rounds awaiting replies, and the reader thread.

    Sending a round (check the stream is alive, await its reply, queue it) and the reader's ending
    (mark it dead, fail every round still awaiting a reply) each happen under one lock: otherwise a
    round sent as the stream ends would wait for a reply nobody is left to read.
    """

    def __init__(self, endpoint: _Endpoint, client: VerifierClient, direct: bool) -> None:
        """direct: `endpoint` is a replica's own, not the front door."""
        self.address = endpoint.address
        self.direct = direct
        self.requests: queue.Queue = queue.Queue()
        self.pending: collections.deque[PendingRound] = collections.deque()
        self.dead = False  # takes no more rounds
        self._closed = False  # ended by close(), not by the server
        self._lock = threading.Lock()
        self.call = endpoint.stub.VerifyStream(iter(self.requests.get, _END), metadata=client.metadata)
        threading.Thread(target=self._read, args=(client,), daemon=True, name="verify-stream").start()

    def _read(self, client: VerifierClient) -> None:
        error: HybridSpecError
        try:
            for reply in self.call:
                round_ = self.pending.popleft()
                round_.arrived = time.perf_counter()
                client._count(down=reply.ByteSize())
                round_.future.set_result(codec.result_from_pb(reply))
            error = Unavailable(f"the verifier at {self.address} ended the stream")
        except grpc.RpcError as exc:
            error = _domain_error(exc, self.address)
        if self.direct and isinstance(error, Unavailable) and not self._closed:
            error = client.replica_lost(self.address, str(error))
        with self._lock:
            self.dead = True
            stranded = list(self.pending)
            self.pending.clear()
        self.requests.put(_END)  # gRPC's thread reading the requests ends with the call
        for round_ in stranded:
            round_.future.set_exception(error)

    def send(self, round_: PendingRound, request: pb.VerifyRequest) -> bool:
        """Queue one round; False (nothing queued) if the stream has ended."""
        with self._lock:
            if self.dead:
                return False
            self.pending.append(round_)  # before sending: the reader pops in reply order
            self.requests.put(request)
            return True

    def close(self) -> None:
        """End the stream from this side."""
        with self._lock:
            self.dead = self._closed = True
        self.requests.put(_END)


class VerifierClient:
    """A connection to a verifier pool's front door, and to the replica holding the current session."""

    def __init__(self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S, access: CloudAccess = CloudAccess()) -> None:
        """access: TLS and token (EdgeConfig.cloud_access); the default is plaintext without a token."""
        self.address = address
        self.timeout_s = timeout_s
        self.access = access
        self.metadata = (("authorization", f"Bearer {access.token}"),) if access.token else ()
        self.uplink_bytes = 0
        self.downlink_bytes = 0
        self._lock = threading.Lock()
        # Replica endpoints serve the front door's certificate: check them against the front door's name.
        self._server_name = access.tls.server_name or address.rsplit(":", 1)[0].strip("[]")
        self._front = _Endpoint(address, access, access.tls.server_name)
        self._direct: _Endpoint | None = None  # where rounds go instead of the front door
        self._avoid: dict[str, float] = {}  # replica endpoint -> when it may be dialled again
        self._stream: _Stream | None = None
        self._closing: list[grpc.Future] = []  # CloseSession calls sent without waiting for their reply
        self._streamed_opens = True  # the server reports an open's progress (OpenSessionStream)

    @property
    def rounds_address(self) -> str:
        """Where the next round goes: the session's replica endpoint, or the front door."""
        return self._direct.address if self._direct is not None else self.address

    def close(self) -> None:
        """End the stream, let the session closes already sent arrive (bounded), close the channels."""
        self._end_stream()
        self._route("")
        deadline = time.monotonic() + CLOSE_FLUSH_S
        with self._lock:
            closing, self._closing = self._closing, []
        for call in closing:
            try:
                call.result(timeout=max(0.0, deadline - time.monotonic()))
            except (grpc.RpcError, grpc.FutureTimeoutError):
                pass  # the verifier expires idle sessions itself
        self._front.channel.close()

    def __enter__(self) -> VerifierClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def model_info(self, timeout_s: float | None = None) -> ModelInfo:
        """What the verifier serves (also a cheap round trip: see `ping`)."""
        reply = self._unary(self._front.stub.GetModelInfo, pb.GetModelInfoRequest(), timeout_s)
        return codec.model_info_from_pb(reply)

    def ping(self, timeout_s: float | None = None) -> float:
        """Seconds for one small unary round trip."""
        t0 = time.perf_counter()
        self.model_info(timeout_s)
        return time.perf_counter() - t0

    def open_session(self, spec: SessionSpec) -> SessionOpened:
        """Open (spec.session_id empty) or re-open a session; returns the id the server issued for it,
        which every later call must carry, and the committed length the verifier now holds."""
        return self.begin_open(spec).result()

    def begin_open(self, spec: SessionSpec) -> Opening:
        """Send an OpenSession now and return it in flight: its progress as it comes and its reply
        (`open_session`'s result), so that the caller's own work overlaps the cloud's prefill and the link."""
        self._end_stream()
        return Opening(self, spec)

    def replica_lost(self, address: str, why: str) -> ReplicaUnreachable:
        """The error for a round whose replica endpoint failed; rounds avoid that endpoint for a while."""
        with self._lock:
            self._avoid[address] = time.monotonic() + AVOID_UNREACHABLE_S
        return ReplicaUnreachable(f"{why}; re-open the session at the front door")

    def close_session(self, session_id: str) -> bool:
        """Free the session on the verifier."""
        self._end_stream()
        return self._unary(self._front.stub.CloseSession, pb.CloseSessionRequest(session_id=session_id)).existed

    def close_session_later(self, session_id: str) -> None:
        """Free the session without waiting for the reply (a round trip the edge need not spend);
        `close` lets it arrive before the channel goes."""
        self._end_stream()
        request = pb.CloseSessionRequest(session_id=session_id)
        self._count(up=request.ByteSize())
        call = self._front.stub.CloseSession.future(request, timeout=self.timeout_s, metadata=self.metadata)
        with self._lock:
            self._closing = [c for c in self._closing if not c.done()] + [call]

    def submit(self, block: DraftBlock) -> PendingRound:
        """Send one round on the session's stream; the reply arrives in the returned handle."""
        request = codec.block_to_pb(block)
        round_ = PendingRound(block, time.perf_counter())
        while self._stream is None or not self._stream.send(round_, request):
            self._end_stream()  # the server ended it: let its threads go, then open a new one
            direct = self._direct
            self._stream = _Stream(direct or self._front, self, direct is not None)
        self._count(up=request.ByteSize())
        return round_

    def wait(self, round_: PendingRound, timeout_s: float | None = None) -> VerifyResult:
        """The reply to a submitted round; Unavailable if none comes within the timeout."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            return round_.future.result(timeout=max(0.0, round_.sent + timeout - time.perf_counter()))
        except FutureTimeout:
            stream = self._stream
            self._end_stream(cancel=True)
            why = f"cloud verifier at {stream.address if stream else self.address} did not answer within {timeout:g} s"
            if stream is not None and stream.direct:
                raise self.replica_lost(stream.address, why) from None
            raise Unavailable(why) from None

    def verify(self, block: DraftBlock) -> VerifyResult:
        """Send one round and wait for its reply."""
        return self.wait(self.submit(block))

    def generate(self, spec: GenerateSpec) -> TokenStream:
        """Cloud-only decoding: the request leaves now, and the TokenStream returned yields the target's
        tokens as they stream in (closing it early cancels the stream). Sending before the first read
        lets the caller's own set-up overlap the cloud's prefill and the round trip."""
        request = codec.generate_to_pb(spec)
        self._count(up=request.ByteSize())
        call = self._front.stub.Generate(request, timeout=self._deadline(len(spec.prompt_ids), spec.max_new_tokens),
                                         metadata=self.metadata)
        return TokenStream(call, self, self.address)

    def decode(self, spec: DecodeSpec) -> TokenStream:
        """Cloud-only decoding on the open session: the target's tokens, streamed from where its rounds
        go (its replica's own endpoint when the open named one, skipping the front door and Ray).
        Closing the stream early cancels it."""
        request = codec.decode_to_pb(spec)
        self._count(up=request.ByteSize())
        endpoint = self._direct or self._front
        call = endpoint.stub.Decode(request, timeout=self._deadline(new=spec.max_new_tokens), metadata=self.metadata)
        return TokenStream(call, self, endpoint.address, direct=endpoint is self._direct)

    def _deadline(self, prompt: int = 0, new: int = 0) -> float:
        """Seconds a call that prefills `prompt` tokens and streams `new` may take: the timeout, which
        says when a silent cloud counts as unreachable, plus the time of the work itself, generously."""
        return self.timeout_s + PREFILL_S_PER_TOKEN * prompt + DECODE_S_PER_TOKEN * new

    def _unary(self, method, request, timeout_s: float | None = None):
        self._count(up=request.ByteSize())
        try:
            reply = method(request, timeout=self.timeout_s if timeout_s is None else timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise _domain_error(exc, self.address) from None
        self._count(down=reply.ByteSize())
        return reply

    def _count(self, up: int = 0, down: int = 0) -> None:
        with self._lock:
            self.uplink_bytes += up
            self.downlink_bytes += down

    def _route(self, verify_address: str) -> None:
        """Send rounds to `verify_address` ("" or an endpoint to avoid: the front door). A channel to
        the same replica is kept across sessions; one to another replica is closed."""
        with self._lock:
            if self._avoid.get(verify_address, 0.0) > time.monotonic():
                verify_address = ""
        if self._direct is not None and self._direct.address != verify_address:
            self._direct.channel.close()
            self._direct = None
        if verify_address and self._direct is None:
            self._direct = _Endpoint(verify_address, self.access, self._server_name)

    def _end_stream(self, cancel: bool = False) -> None:
        if self._stream is not None:
            if cancel:
                self._stream.call.cancel()
            self._stream.close()
            self._stream = None


# What gRPC's connection errors say about TLS, and what the edge's user should hear instead.
TLS_HINTS = (
    ("CERTIFICATE_VERIFY_FAILED", "the cloud's TLS certificate is not signed by a trusted CA (check --tls-ca)"),
    ("Hostname Verification", "the cloud's TLS certificate does not name that host (check --tls-server-name)"),
    ("WRONG_VERSION_NUMBER", "TLS handshake failed: the cloud may not speak TLS (drop --tls)"),
    ("PEER_DID_NOT_RETURN_A_CERTIFICATE", "the cloud requires a client certificate (--tls-cert, --tls-key)"),
)


def _domain_error(exc: grpc.RpcError, address: str) -> HybridSpecError:
    code = exc.code()
    detail = exc.details() or ""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        hint = next((text for marker, text in TLS_HINTS if marker in detail), None)
        if hint is not None:
            detail = f"cannot connect to the cloud verifier at {address}: {hint}"
        else:
            detail = f"cloud verifier at {address} is unreachable or not responding ({code.name}: {detail})"
        code = grpc.StatusCode.UNAVAILABLE
    elif code is grpc.StatusCode.UNAUTHENTICATED:
        detail = f"the cloud verifier at {address} refused this edge's credentials: {detail}"
    return error_for_code(code.name, detail, _retry_after_s(exc))


def _retry_after_s(exc: grpc.RpcError) -> float | None:
    """The server's hint of when a retry may succeed (RetryInfo in the status details), if it gave one."""
    try:
        status = rpc_status.from_call(exc)
    except (AttributeError, ValueError):  # no call behind it, or details that do not match the status
        return None
    for detail in status.details if status is not None else ():
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return info.retry_delay.ToTimedelta().total_seconds()
    return None


class TokenStream:
    """The target's tokens of one `Generate` or `Decode` call, as they stream in; `close` (or dropping it)
    cancels the call, which is a no-op once the stream has ended. A stream from a replica's own endpoint
    that stops answering fails with ReplicaUnreachable (re-open at the front door)."""

    def __init__(self, call, client: VerifierClient, address: str, direct: bool = False) -> None:
        self._call, self._client, self._address, self._direct = call, client, address, direct

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> int:
        try:
            reply = next(self._call)
        except grpc.RpcError as exc:
            self._call.cancel()
            error = _domain_error(exc, self._address)
            if self._direct and isinstance(error, Unavailable):
                raise self._client.replica_lost(self._address, str(error)) from None
            raise error from None
        self._client._count(down=reply.ByteSize())
        return reply.token_id

    def close(self) -> None:
        """Stop the stream (the server stops decoding for it)."""
        self._call.cancel()

    def __del__(self) -> None:
        self._call.cancel()
