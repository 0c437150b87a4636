"""gRPC servicer: decode -> call the verifier core -> encode. No tensors, no verification logic."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc

from ..common import codec
from ..common.errors import HybridSpecError
from ..common.proto import verifier_pb2 as pb
from ..common.proto import verifier_pb2_grpc as pb_grpc
from .verifier import Verifier

R = TypeVar("R")


class VerifierService(pb_grpc.VerifierServicer):
    """Serves one Verifier core; model work runs in worker threads so the event loop stays free."""

    def __init__(self, core: Verifier) -> None:
        self.core = core

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[[], R]) -> R:
        try:
            return await asyncio.to_thread(fn)
        except HybridSpecError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
            raise  # unreachable: abort raises

    async def GetModelInfo(self, request, context):
        return codec.model_info_to_pb(self.core.info)

    async def OpenSession(self, request, context):
        spec = await self._call(context, lambda: codec.session_from_pb(request))
        n = await self._call(context, lambda: self.core.open_session(spec))
        return pb.OpenSessionReply(committed_len=n)

    async def Verify(self, request, context):
        block = codec.block_from_pb(request)
        result = await self._call(context, lambda: self.core.verify(block))
        return codec.result_to_pb(result)

    async def VerifyStream(self, request_iterator, context) -> AsyncIterator[pb.VerifyReply]:
        async for request in request_iterator:
            block = codec.block_from_pb(request)
            result = await self._call(context, lambda b=block: self.core.verify(b))
            yield codec.result_to_pb(result)

    async def CloseSession(self, request, context):
        existed = await self._call(context, lambda: self.core.close_session(request.session_id))
        return pb.CloseSessionReply(existed=existed)

    async def Generate(self, request, context) -> AsyncIterator[pb.GenerateReply]:
        spec = await self._call(context, lambda: codec.generate_from_pb(request))
        tokens = await self._call(context, lambda: self.core.generate(spec))
        done = object()
        while True:
            token = await self._call(context, lambda: next(tokens, done))
            if token is done:
                return
            yield pb.GenerateReply(token_id=token)
