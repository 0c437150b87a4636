"""Cloud-only decoding: the stream of decode steps the model thread drives, and the loops that run
the `Decode` and `Generate` RPCs over whoever holds the sessions.

A cloud-only token is the bonus token of an empty round. Sent one round at a time from an event
loop, every token waits for its answer to cross to the loop and for the next round to cross back,
while the engine idles: on llama.cpp's CPU kernels, where a token takes a few milliseconds, that hop
was a tenth of the time. A `DecodeStream` instead lives on the model thread: when a step answers one
of its rounds, the scheduler queues the next round at once (`answered`), and the token goes to the
consumer's event loop without anything waiting for it. Rounds of a stream are ordinary rounds, so
they batch with other sessions' and obey every rule a round does; the stream ends after its budget,
at an end-of-sequence token, on an error, or when its consumer goes away.

Above a replica, `decode_tokens` (a session the client opened: the `Decode` RPC, at the front door or
a replica's own endpoint) and `generate_tokens` (a session of its own: the `Generate` RPC) are written
once against `Decoder` and `Sessions`, which the pool (cloud/pool/pool.py) and a replica's endpoint
satisfy; a lost session is re-opened from the tokens so far.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Protocol

from ...common.protocol.errors import FailedPrecondition, HybridSpecError
from ...common.protocol.wire import (DecodeSpec, DraftBlock, GenerateSpec, Mode, ModelInfo, SessionOpened,
                                     SessionSpec, VerifyResult, check_context)
from ...common.security.credentials import Identity

_END = object()  # the stream's last item


class DecodeStream:
    """One session's decode steps; `answered` runs on the model thread, `tokens` on the consumer's loop."""

    def __init__(self, first: DraftBlock, max_tokens: int, eos: frozenset[int], loop: asyncio.AbstractEventLoop) -> None:
        self.first = first  # an empty block at the session's current length
        self._left = max_tokens
        self._eos = eos
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._gone = False  # the consumer stopped listening

    def answered(self, block: DraftBlock, result: VerifyResult | HybridSpecError) -> DraftBlock | None:
        """Hand a step's answer to `block` to the consumer; returns the next round to queue, or None
        when the stream is over (budget spent, end of sequence, an error, nobody listening)."""
        if not isinstance(result, VerifyResult):
            self._push(result)
            return None
        token = result.next_token
        self._left -= 1
        self._push(token)
        if self._left > 0 and token not in self._eos and not self._gone:
            return replace(block, round=block.round + 1, committed_len=block.committed_len + 1)
        self._push(_END)
        return None

    async def tokens(self) -> AsyncIterator[int]:
        """The stream's tokens as they are decoded; raises the domain error that ended it, if any."""
        try:
            while True:
                item = await self._queue.get()
                if item is _END:
                    return
                if isinstance(item, HybridSpecError):
                    raise item
                yield item
        finally:
            self._gone = True

    def _push(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            self._gone = True


class Decoder(Protocol):
    """Whoever decodes the sessions a caller holds: the pool, or a replica's own endpoint."""

    def model_info(self) -> ModelInfo:
        """What is served."""

    def decode(self, block: DraftBlock, max_tokens: int, eos: frozenset[int], caller: Identity) -> AsyncIterator[int]:
        """Up to `max_tokens` tokens of `caller`'s session from the empty block `block`, as they are decoded."""


class Sessions(Decoder, Protocol):
    """A decoder that also opens and closes sessions (the pool at the front door)."""

    async def open_session(self, spec: SessionSpec, caller: Identity) -> SessionOpened:
        """Open a session for `caller`, or re-open the live one spec.session_id names."""

    async def close_session(self, session_id: str, caller: Identity) -> bool:
        """Free `caller`'s session."""


async def decode_tokens(decoder: Decoder, spec: DecodeSpec, caller: Identity) -> AsyncIterator[int]:
    """Cloud-only decoding on a session the caller opened: its tokens as the replica decodes them.
    Validated before anything is decoded."""
    info = decoder.model_info()
    spec.validate(info.max_context)
    first = DraftBlock(spec.session_id, spec.round, spec.committed_len, ())  # an empty round: the first token
    async for token in decoder.decode(first, spec.max_new_tokens, frozenset(info.eos_token_ids), caller):
        yield token


async def generate_tokens(sessions: Sessions, spec: GenerateSpec, caller: Identity) -> AsyncIterator[int]:
    """Cloud-only decoding: the target alone, one token per round of an empty draft.

    Every token is the 'bonus' of an empty block, so cloud-only streams are batched with the
    verification rounds of other sessions, and a lost replica is recovered from the tokens so far.
    The replica queues each next round itself (`DecodeStream`), so no token waits on this loop.
    Sampling draws as the coupled rule does, by (seed, absolute position): a seed gives the same
    tokens however a generation is split between hybrid rounds and streams (docs/design.md §2.2).
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
            block = DraftBlock(session_id, generated, len(committed), ())
            try:
                async for token in sessions.decode(block, spec.max_new_tokens - generated, eos, caller):
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
