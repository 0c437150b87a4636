"""gRPC servicer: decode -> call the backend -> encode. No tensors, no verification logic, no Ray."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable

import grpc

from ..common import codec
from ..common.errors import HybridSpecError
from ..common.proto import verifier_pb2 as pb
from ..common.proto import verifier_pb2_grpc as pb_grpc
from .backend import Backend, generate_tokens
from .metrics import Metrics


class VerifierService(pb_grpc.VerifierServicer):
    """Serves one backend (an in-process verifier or the Ray pool)."""

    def __init__(self, backend: Backend, metrics: Metrics) -> None:
        self.backend = backend
        self.metrics = metrics

    async def _abort(self, context: grpc.aio.ServicerContext, code: str, message: str):
        self.metrics.errors.labels(code).inc()
        await context.abort(getattr(grpc.StatusCode, code), message)

    async def _call(self, context: grpc.aio.ServicerContext, work: Awaitable):
        """Await `work` within the call's deadline; domain errors become their gRPC status."""
        try:
            remaining = context.time_remaining()
            return await (asyncio.wait_for(work, remaining) if remaining is not None else work)
        except HybridSpecError as exc:
            await self._abort(context, exc.code, str(exc))
        except asyncio.TimeoutError:
            await self._abort(context, "DEADLINE_EXCEEDED", "the verifier did not answer within the deadline")

    async def GetModelInfo(self, request, context):
        return codec.model_info_to_pb(self.backend.info)

    async def OpenSession(self, request, context):
        try:
            spec = codec.session_from_pb(request)
        except HybridSpecError as exc:
            await self._abort(context, exc.code, str(exc))
        n = await self._call(context, self.backend.open_session(spec))
        (self.metrics.reopens if spec.next_round > 0 else self.metrics.sessions_opened).inc()
        return pb.OpenSessionReply(committed_len=n)

    async def Verify(self, request, context):
        return await self._verify(request, context)

    async def VerifyStream(self, request_iterator, context) -> AsyncIterator[pb.VerifyReply]:
        async for request in request_iterator:
            yield await self._verify(request, context)

    async def _verify(self, request: pb.VerifyRequest, context) -> pb.VerifyReply:
        block = codec.block_from_pb(request)
        start = time.perf_counter()
        result = await self._call(context, self.backend.verify(block))
        self.metrics.observe_round(len(block.draft_ids), result, time.perf_counter() - start)
        return codec.result_to_pb(result)

    async def CloseSession(self, request, context):
        existed = await self._call(context, self.backend.close_session(request.session_id))
        return pb.CloseSessionReply(existed=existed)

    async def Generate(self, request, context) -> AsyncIterator[pb.GenerateReply]:
        try:
            spec = codec.generate_from_pb(request)
            async for token in generate_tokens(self.backend, spec):
                self.metrics.generated_tokens.inc()
                yield pb.GenerateReply(token_id=token)
        except HybridSpecError as exc:
            await self._abort(context, exc.code, str(exc))
