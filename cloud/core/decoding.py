"""Cloud-only decoding that keeps the model thread busy: a stream of decode steps for one session.

A cloud-only token is the bonus token of an empty round. Sent one round at a time from an event
loop, every token waits for its answer to cross to the loop and for the next round to cross back,
while the engine idles: on llama.cpp's CPU kernels, where a token takes a few milliseconds, that hop
was a tenth of the time. A `DecodeStream` instead lives on the model thread: when a step answers one
of its rounds, the scheduler queues the next round at once (`answered`), and the token goes to the
consumer's event loop without anything waiting for it. Rounds of a stream are ordinary rounds, so
they batch with other sessions' and obey every rule a round does; the stream ends after its budget,
at an end-of-sequence token, on an error, or when its consumer goes away.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from ...common.protocol.errors import HybridSpecError
from ...common.protocol.wire import DraftBlock, VerifyResult

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
