"""gRPC servicer: decode -> call the backend -> encode. No tensors, no verification logic, no Ray.

The backend is the front door's `Pool` (cloud/pool/pool.py), or, behind a replica's own endpoint
(direct verify), that replica's `Verifier` (cloud/core/verifier.py), which serves rounds and decode
steps only. Every round and decode step is stamped here with its sender (`DraftBlock.owner`): the
pool checks it against the session's route, the verifier against the session itself. The two
cloud-only RPC loops live here too, beside their only caller: `decode_tokens` (`Decode`, on a session
the client opened) and `generate_tokens` (`Generate`, on a session of its own); neither touches a tensor.

Every request is untrusted. Each call is first identified (cloud/api/access.py: its bearer token, or its
address on a server without credentials; UNAUTHENTICATED before anything else is read), then paced
by its identity's rate. Bodies are parsed by deserializers that never raise, so an undecodable one
is INVALID_ARGUMENT (and counted) rather than gRPC's UNKNOWN; session ids are length-checked before
anything looks them up; domain errors become their status; anything else is logged under an
incident id and answered INTERNAL with only that id — never a traceback. Health checking and
reflection are separate services and need no token.
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from ...common.protocol import codec
from ...common.security.credentials import Identity
from ...common.protocol.errors import FailedPrecondition, HybridSpecError, InvalidArgument, incident
from ...common.protocol.proto import verifier_pb2 as pb
from ...common.protocol.wire import (DecodeSpec, DraftBlock, GenerateSpec, Mode, ModelInfo, OpenProgress,
                                     SessionOpened, SessionSpec, VerifyResult, check_context, check_session_id)
from .access import Access, AccessSpec
from .metrics import EndpointTally, Metrics

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Verifier"].full_name
T = TypeVar("T")


@dataclass(frozen=True)
class Undecodable:
    """What a lenient deserializer returns for bytes that are not the expected message."""

    message_type: str


def _lenient(cls: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    def parse(data: bytes) -> Message | Undecodable:
        try:
            return cls.FromString(data)
        except Exception:  # DecodeError, invalid UTF-8 in a string field, ...
            return Undecodable(cls.DESCRIPTOR.name)

    return parse


def identify(access: Access, context: grpc.aio.ServicerContext) -> Identity:
    """The call's caller (access.identify): from its `authorization` metadata value, if it sent one,
    and its address without the port (how callers are told apart on a server without credentials)."""
    authorization = None
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            authorization = value if isinstance(value, str) else None
            break
    peer = context.peer() or "unknown"
    return access.identify(authorization, peer.rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else peer)


class Decoder(Protocol):
    """What a replica's own endpoint serves (a Verifier), and what the front door's pool serves too:
    rounds and decode steps of sessions it holds, each stamped with its sender."""

    # True: the backend charges its callers' rates where the work runs (a Ray pool whose replicas have
    # their own endpoints), and this servicer charges nothing.
    paces: bool

    def model_info(self) -> ModelInfo:
        """What is served."""

    async def averify(self, block: DraftBlock) -> VerifyResult:
        """Verify one round."""

    def adecode(self, block: DraftBlock, max_tokens: int, eos: frozenset[int]) -> AsyncIterator[int]:
        """Up to `max_tokens` tokens of the session from the empty block `block`, as they are decoded."""


class Sessions(Decoder, Protocol):
    """A decoder that also opens and closes sessions for their callers (the front door's pool)."""

    async def open_session(self, spec: SessionSpec, caller: Identity,
                           progress: Callable[[OpenProgress], None] | None = None) -> SessionOpened:
        """Open a session for `caller`, or re-open the live one spec.session_id names, telling
        `progress` how far its replica has got."""

    async def close_session(self, session_id: str, caller: Identity) -> bool:
        """Free `caller`'s session."""


class VerifierService:
    """Serves one backend: the front door's pool (of an in-process verifier or Ray replicas), or a
    replica's own verifier behind its direct endpoint (which registers VerifyStream and Decode only)."""

    def __init__(self, backend: Sessions | Decoder, metrics: Metrics | EndpointTally,
                 access: Access | None = None) -> None:
        """metrics: a replica endpoint passes an EndpointTally; it is only asked about rounds, tokens and errors.
        access: who may call (default: anyone, named by address, unpaced)."""
        self.backend = backend
        self.metrics = metrics
        self.access = access if access is not None else Access(AccessSpec())

    def register(self, server: grpc.aio.Server, only: Collection[str] | None = None) -> None:
        """Add the Verifier RPCs (or those named in `only`) to `server`, with lenient deserializers;
        gRPC answers any other method UNIMPLEMENTED."""
        unary, server_stream, bidi = (grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler,
                                      grpc.stream_stream_rpc_method_handler)
        handlers = {
            "GetModelInfo": unary(self.GetModelInfo, _lenient(pb.GetModelInfoRequest), pb.ModelInfo.SerializeToString),
            "OpenSession": unary(self.OpenSession, _lenient(pb.OpenSessionRequest),
                                 pb.OpenSessionReply.SerializeToString),
            "OpenSessionStream": server_stream(self.OpenSessionStream, _lenient(pb.OpenSessionRequest),
                                               pb.OpenSessionProgress.SerializeToString),
            "Verify": unary(self.Verify, _lenient(pb.VerifyRequest), pb.VerifyReply.SerializeToString),
            "VerifyStream": bidi(self.VerifyStream, _lenient(pb.VerifyRequest), pb.VerifyReply.SerializeToString),
            "CloseSession": unary(self.CloseSession, _lenient(pb.CloseSessionRequest),
                                  pb.CloseSessionReply.SerializeToString),
            "Generate": server_stream(self.Generate, _lenient(pb.GenerateRequest), pb.GenerateReply.SerializeToString),
            "Decode": server_stream(self.Decode, _lenient(pb.DecodeRequest), pb.GenerateReply.SerializeToString),
        }
        if only is not None:
            handlers = {name: handler for name, handler in handlers.items() if name in only}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))

    # ---- the RPCs -----------------------------------------------------------------------------

    async def GetModelInfo(self, request, context):
        async def work() -> pb.ModelInfo:
            identify(self.access, context)
            await self._decoded(request)
            return codec.model_info_to_pb(self.backend.model_info())

        return await self._guard(context, "GetModelInfo", work())

    async def OpenSession(self, request, context):
        return await self._guard(context, "OpenSession", self._open(request, context))

    async def OpenSessionStream(self, request, context) -> AsyncIterator[pb.OpenSessionProgress]:
        """OpenSession with the replica's progress on the way (every second while it has the prompt),
        then a last message with the reply; an error ends the stream with OpenSession's status."""
        updates: asyncio.Queue[OpenProgress] = asyncio.Queue()
        opening = asyncio.ensure_future(self._guard(context, "OpenSessionStream",
                                                    self._open(request, context, updates.put_nowait)))
        update = None
        try:
            while not opening.done():
                update = asyncio.ensure_future(updates.get())
                await asyncio.wait({opening, update}, return_when=asyncio.FIRST_COMPLETED)
                if update.done():
                    yield codec.progress_to_pb(update.result())
            reply = opening.result()  # the abort the guard made, if the open failed
        finally:
            for task in (opening, update):  # the client went away: the open is abandoned
                if task is not None:
                    task.cancel()
        yield pb.OpenSessionProgress(opened=reply)

    async def Verify(self, request, context):
        return await self._guard(context, "Verify", self._verify(request, context))

    async def VerifyStream(self, request_iterator, context) -> AsyncIterator[pb.VerifyReply]:
        async for request in request_iterator:
            yield await self._guard(context, "VerifyStream", self._verify(request, context))

    async def CloseSession(self, request, context):
        async def work() -> pb.CloseSessionReply:
            caller = identify(self.access, context)
            message = await self._decoded(request)
            check_session_id(message.session_id)
            return pb.CloseSessionReply(existed=await self.backend.close_session(message.session_id, caller))

        return await self._guard(context, "CloseSession", work())

    async def Generate(self, request, context) -> AsyncIterator[pb.GenerateReply]:
        async def start() -> tuple[Identity, AsyncIterator[int]]:
            caller = identify(self.access, context)
            spec = codec.generate_from_pb(await self._decoded(request))
            await self._pace(caller, len(spec.prompt_ids))
            self.metrics.observe_opened(len(spec.prompt_ids))
            return caller, generate_tokens(self.backend, spec, caller)

        async for reply in self._stream_tokens(context, "Generate", start()):
            yield reply

    async def Decode(self, request, context) -> AsyncIterator[pb.GenerateReply]:
        async def start() -> tuple[Identity, AsyncIterator[int]]:
            caller = identify(self.access, context)
            spec = codec.decode_from_pb(await self._decoded(request))
            check_session_id(spec.session_id)
            return caller, decode_tokens(self.backend, spec, caller)

        async for reply in self._stream_tokens(context, "Decode", start()):
            yield reply

    # ---- helpers ------------------------------------------------------------------------------

    async def _open(self, request, context: grpc.aio.ServicerContext,
                    progress: Callable[[OpenProgress], None] | None = None) -> pb.OpenSessionReply:
        caller = identify(self.access, context)
        message = await self._decoded(request)
        check_session_id(message.session_id, allow_empty=True)
        spec = codec.session_from_pb(message)
        await self._pace(caller, len(spec.committed_ids))
        opened = await self.backend.open_session(spec, caller, progress)
        # A generation that already has rounds behind it is being resumed, whatever id it gets.
        (self.metrics.reopens if spec.next_round > 0 else self.metrics.sessions_opened).inc()
        self.metrics.observe_opened(len(spec.committed_ids), opened)
        return codec.opened_to_pb(opened)

    async def _stream_tokens(self, context: grpc.aio.ServicerContext, rpc: str,
                             start: Awaitable[tuple[Identity, AsyncIterator[int]]]) -> AsyncIterator[pb.GenerateReply]:
        """A cloud-only stream's replies, each token paced at the caller's rate; closing it (the client
        went away) stops the decoding."""
        caller, tokens = await self._guard(context, rpc, start)
        try:
            while True:
                token = await self._guard(context, rpc, self._next_token(caller, tokens))
                if token is None:
                    return
                self.metrics.observe_generated()
                yield pb.GenerateReply(token_id=token)
        finally:
            await tokens.aclose()  # a Generate closes its session when the client leaves early

    async def _verify(self, request, context: grpc.aio.ServicerContext) -> pb.VerifyReply:
        caller = identify(self.access, context)
        block = codec.block_from_pb(await self._decoded(request), caller.owner)
        check_session_id(block.session_id)
        start = time.perf_counter()
        await self._pace(caller, len(block.draft_ids) + 1)
        result = await self.backend.averify(block)
        self.metrics.observe_round(len(block.draft_ids), result, time.perf_counter() - start)
        return codec.result_to_pb(result)

    async def _next_token(self, caller: Identity, tokens: AsyncIterator[int]) -> int | None:
        await self._pace(caller, 1)
        return await anext(tokens, None)

    async def _pace(self, caller: Identity, tokens: int) -> None:
        if self.backend.paces:
            return
        delay = self.access.pace(caller, tokens)
        if delay > 0:
            await asyncio.sleep(delay)

    @staticmethod
    async def _decoded(request: Message | Undecodable) -> Message:
        if isinstance(request, Undecodable):
            raise InvalidArgument(f"the request body is not a valid {request.message_type} message")
        return request

    async def _guard(self, context: grpc.aio.ServicerContext, rpc: str, work: Awaitable[T]) -> T:
        """Await `work` within the call's deadline; every failure becomes one status with a message."""
        retry_after_s = None
        try:
            remaining = context.time_remaining()
            if remaining is None:  # no deadline (an edge's VerifyStream): no timer per message either
                return await work
            # asyncio.timeout, not wait_for: no task per call (Generate guards every token).
            async with asyncio.timeout(remaining):
                return await work
        except HybridSpecError as exc:
            code, message, retry_after_s = exc.code, str(exc), exc.retry_after_s
        except asyncio.TimeoutError:
            code, message = "DEADLINE_EXCEEDED", "the verifier did not answer within the deadline"
        except Exception as exc:
            error = incident(log, exc, rpc)
            code, message = error.code, str(error)
        self.metrics.observe_error(code)
        await context.abort(getattr(grpc.StatusCode, code), message, retry_info(code, message, retry_after_s))
        raise AssertionError("context.abort returned")  # it always raises


def retry_info(code: str, message: str, retry_after_s: float | None) -> tuple:
    """The trailing metadata of an error with a retry hint: the standard google.rpc.Status with a
    RetryInfo detail (`grpc-status-details-bin`, what grpcio-status and other gRPC stacks read); none
    without a hint."""
    if retry_after_s is None:
        return ()
    delay = duration_pb2.Duration()
    delay.FromTimedelta(datetime.timedelta(seconds=retry_after_s))
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    status = status_pb2.Status(code=getattr(code_pb2, code), message=message, details=[detail])
    return tuple(rpc_status.to_status(status).trailing_metadata)


async def decode_tokens(decoder: Decoder, spec: DecodeSpec, caller: Identity) -> AsyncIterator[int]:
    """Cloud-only decoding on a session the caller opened: its tokens as the replica decodes them.
    Validated before anything is decoded."""
    info = decoder.model_info()
    spec.validate(info.max_context)
    first = DraftBlock(spec.session_id, spec.round, spec.committed_len, (), owner=caller.owner)  # an empty round
    async for token in decoder.adecode(first, spec.max_new_tokens, frozenset(info.eos_token_ids)):
        yield token


async def generate_tokens(sessions: Sessions, spec: GenerateSpec, caller: Identity) -> AsyncIterator[int]:
    """Cloud-only decoding: the target alone, one token per round of an empty draft.

    Every token is the 'bonus' of an empty block, so cloud-only streams are batched with the
    verification rounds of other sessions, and a lost replica is recovered from the tokens so far.
    The replica queues each next round itself (cloud/core/verifier.py `DecodeStream`), so no token
    waits on this loop. Sampling draws as the coupled rule does, by (seed, absolute position): a seed
    gives the same tokens however a generation is split between hybrid rounds and streams
    (docs/design.md §2.2).
    """
    # 1. Validate, then open a session of the stream's own.
    info = sessions.model_info()
    spec.validate(info.vocab_size)
    check_context(len(spec.prompt_ids), spec.max_new_tokens, info.max_context)
    session = SessionSpec(session_id="", committed_ids=tuple(spec.prompt_ids), sampling=spec.sampling,
                          mode=Mode.GREEDY if spec.sampling.greedy else Mode.COUPLED,
                          seed=spec.seed, tokenizer_fingerprint=spec.tokenizer_fingerprint,
                          prompt_len=spec.prompt_end)
    committed = list(spec.prompt_ids)
    session_id = (await sessions.open_session(session, caller)).session_id
    eos = frozenset(info.eos_token_ids)
    reopened_at = -1  # a session lost twice without a token in between is an error, not a retry
    try:
        while (generated := len(committed) - len(spec.prompt_ids)) < spec.max_new_tokens:
            # 2. Decode the rest of the budget in one stream, up to an end-of-sequence token.
            block = DraftBlock(session_id, generated, len(committed), (), owner=caller.owner)
            try:
                async for token in sessions.adecode(block, spec.max_new_tokens - generated, eos):
                    committed.append(token)
                    yield token
                    if token in eos:
                        return
            except FailedPrecondition:  # 3. Evicted, or its replica was lost: re-open from the tokens so far.
                if reopened_at == generated:
                    raise
                reopened_at = generated
                reopen = replace(session, session_id=session_id, committed_ids=tuple(committed), next_round=generated)
                session_id = (await sessions.open_session(reopen, caller)).session_id
    finally:
        await sessions.close_session(session_id, caller)
