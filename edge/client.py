"""gRPC client for the verifier: wire dataclasses in and out, gRPC errors as domain errors.

Verification rounds travel on one bidirectional stream per session; a failed stream is reopened
on the next call. Uplink/downlink counters hold serialized message bytes (no HTTP/2 framing).
"""
from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc

from ..common import codec
from ..common.errors import error_for_code
from ..common.proto import verifier_pb2 as pb
from ..common.proto import verifier_pb2_grpc as pb_grpc
from ..common.wire import DraftBlock, GenerateSpec, ModelInfo, SessionSpec, VerifyResult

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]
_END = object()


class VerifierClient:
    """A connection to one verifier endpoint."""

    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.uplink_bytes = 0
        self.downlink_bytes = 0
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.VerifierStub(self._channel)
        self._requests: queue.Queue | None = None
        self._replies: Iterator[pb.VerifyReply] | None = None

    def close(self) -> None:
        """End the stream and the channel."""
        self._end_stream()
        self._channel.close()

    def __enter__(self) -> VerifierClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def model_info(self) -> ModelInfo:
        """What the verifier serves."""
        reply = self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest())
        return codec.model_info_from_pb(reply)

    def open_session(self, spec: SessionSpec) -> int:
        """Open or re-open a session; returns the committed length the verifier now holds."""
        self._end_stream()
        return self._unary(self._stub.OpenSession, codec.session_to_pb(spec)).committed_len

    def close_session(self, session_id: str) -> bool:
        """Free the session on the verifier."""
        self._end_stream()
        return self._unary(self._stub.CloseSession, pb.CloseSessionRequest(session_id=session_id)).existed

    def verify(self, block: DraftBlock) -> VerifyResult:
        """Send one block on the session's stream and wait for its reply."""
        request = codec.block_to_pb(block)
        if self._requests is None:
            self._requests = queue.Queue()
            self._replies = self._stub.VerifyStream(iter(self._requests.get, _END))
        self._requests.put(request)
        self.uplink_bytes += request.ByteSize()
        try:
            reply = next(self._replies)
        except grpc.RpcError as exc:
            self._end_stream()
            raise _domain_error(exc, self.address) from None
        self.downlink_bytes += reply.ByteSize()
        return codec.result_from_pb(reply)

    def generate(self, spec: GenerateSpec) -> Iterator[int]:
        """Cloud-only decoding: yields the target's tokens as they stream in."""
        request = codec.generate_to_pb(spec)
        self.uplink_bytes += request.ByteSize()
        try:
            for reply in self._stub.Generate(request):
                self.downlink_bytes += reply.ByteSize()
                yield reply.token_id
        except grpc.RpcError as exc:
            raise _domain_error(exc, self.address) from None

    def _unary(self, method, request):
        self.uplink_bytes += request.ByteSize()
        try:
            reply = method(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise _domain_error(exc, self.address) from None
        self.downlink_bytes += reply.ByteSize()
        return reply

    def _end_stream(self) -> None:
        if self._requests is not None:
            self._requests.put(_END)
            self._requests = None
            self._replies = None


def _domain_error(exc: grpc.RpcError, address: str):
    code = exc.code()
    detail = exc.details() or ""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        detail = f"cloud verifier at {address} is unreachable or not responding ({code.name}: {detail})"
    return error_for_code(code.name, detail)
