"""Admission at call start: a gRPC server interceptor in front of every Verifier RPC.

Before a Verifier call may wait for anything, it is identified from its metadata and peer (cloud/
access.py: UNAUTHENTICATED on a server with credentials when its token is missing or unknown) and
counted against its caller's concurrent-call limit (RESOURCE_EXHAUSTED beyond it). A refused call
ends at once, so it never holds one of the server's concurrent-RPC slots: a flood of calls without a
token cannot lock token holders out, and one identity's idle calls cannot take everyone's slots. A
VerifyStream that sends no message for `stream_idle_s` is ended with UNAVAILABLE (the edge opens a
new stream with its next round). Health checking and reflection are not Verifier RPCs and pass as
they are. The servicer still identifies every message, so a token revoked mid-stream stops working.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from ...common.security.credentials import Identity
from ...common.protocol.errors import HybridSpecError
from .access import Access
from .metrics import EndpointTally, Metrics
from .service import SERVICE_NAME, identify

_PREFIX = f"/{SERVICE_NAME}/"


class Admission(grpc.aio.ServerInterceptor):
    """Identifies, counts and (for streams) times out every Verifier call of one server."""

    def __init__(self, access: Access, metrics: Metrics | EndpointTally) -> None:
        """access: the endpoint's gatekeeper (shared with its servicer); metrics: where refusals count."""
        self.access = access
        self.metrics = metrics

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(_PREFIX):
            return handler
        kinds = {(False, False): self._unary, (False, True): self._server_stream, (True, True): self._bidi}
        return kinds[handler.request_streaming, handler.response_streaming](handler)

    # ---- one wrapper per kind of RPC the Verifier service has -------------------------------------

    def _unary(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        async def behavior(request, context):
            caller = await self._enter(context)
            try:
                return await handler.unary_unary(request, context)
            finally:
                self.access.leave_call(caller)

        return grpc.unary_unary_rpc_method_handler(behavior, handler.request_deserializer,
                                                   handler.response_serializer)

    def _server_stream(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        async def behavior(request, context):
            caller = await self._enter(context)
            try:
                async for reply in handler.unary_stream(request, context):
                    yield reply
            finally:
                self.access.leave_call(caller)

        return grpc.unary_stream_rpc_method_handler(behavior, handler.request_deserializer,
                                                    handler.response_serializer)

    def _bidi(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        async def behavior(requests, context):
            caller = await self._enter(context)
            try:
                async for reply in handler.stream_stream(self._until_idle(requests, context), context):
                    yield reply
            finally:
                self.access.leave_call(caller)

        return grpc.stream_stream_rpc_method_handler(behavior, handler.request_deserializer,
                                                     handler.response_serializer)

    # ---- the rules ---------------------------------------------------------------------------------

    async def _enter(self, context: grpc.aio.ServicerContext) -> Identity:
        """The caller, now counted; the call is aborted (and the refusal counted) otherwise."""
        try:
            caller = identify(self.access, context)
            self.access.enter_call(caller)
            return caller
        except HybridSpecError as exc:
            await self._abort(context, exc.code, str(exc))
            raise AssertionError("context.abort returned") from None  # it always raises

    async def _until_idle(self, requests: AsyncIterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
        """The stream's messages; the call is aborted once it has waited `stream_idle_s` for the next one."""
        idle_s = self.access.spec.stream_idle_s
        watch = _IdleWatch(idle_s)
        messages = aiter(requests)
        try:
            while True:
                watch.waiting()
                try:
                    message = await anext(messages)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if not watch.ended_the_wait():
                        raise  # the call itself was cancelled
                    await self._abort(context, "UNAVAILABLE", f"no message on this stream for {idle_s:g} s; "
                                                              "it was closed: open a new one")
                watch.handling()
                yield message
        finally:
            watch.close()

    async def _abort(self, context: grpc.aio.ServicerContext, code: str, message: str) -> None:
        self.metrics.observe_error(code)
        await context.abort(getattr(grpc.StatusCode, code), message)


class _IdleWatch:
    """Ends a stream's wait for its next message once it has lasted `idle_s`, by cancelling the call's task
    (as asyncio.timeout does). One timer per stream, moved only when it fires: a message just notes the
    time. A timer made and cancelled per message (asyncio.timeout around each read) cost about 4 % of the
    front door's CPU under 64 edges. The wait is the only time counted: a round the verifier takes long
    to answer never ends its stream."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._cancelling = self._task.cancelling()  # cancellations asked before ours are not ours to absorb
        self._since: float | None = None  # when the current wait began; None while a message is handled
        self._expired = False
        self._timer = self._loop.call_later(idle_s, self._check)

    def waiting(self) -> None:
        """The stream now waits for its next message."""
        self._since = self._loop.time()

    def handling(self) -> None:
        """A message came; the stream handles it."""
        self._since = None

    def ended_the_wait(self) -> bool:
        """Whether the cancellation that interrupted the wait was ours alone (then it is absorbed)."""
        return self._expired and self._task.uncancel() <= self._cancelling

    def close(self) -> None:
        self._timer.cancel()

    def _check(self) -> None:
        now, since = self._loop.time(), self._since
        if since is not None and now - since >= self.idle_s:
            self._expired = True
            self._task.cancel()
        else:  # handling a message, or waiting for less than idle_s: look again when the wait could expire
            self._timer = self._loop.call_at((now if since is None else since) + self.idle_s, self._check)
