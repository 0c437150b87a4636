"""What the gRPC front door needs from the verifiers behind it, and the in-process implementation.

A backend speaks the wire dataclasses (never protobuf) and raises the domain errors. Two exist: the
`InProcessBackend` here (one Verifier in the front door's process: tests, single-box use, and the
baseline for the Ray hop's cost) and `RayPool` in pool.py (the production pool). Cloud-only
generation is written once, on top of any backend, in `generate_tokens`.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Protocol

from ..common.errors import FailedPrecondition, HybridSpecError, ResourceExhausted
from ..common.wire import DraftBlock, GenerateSpec, Mode, ModelInfo, SessionSpec, VerifyResult
from .batcher import RoundBatcher
from .verifier import Verifier


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as the metrics see it."""

    name: str
    alive: bool
    sessions: int
    cached_tokens: int
    evictions: int  # sessions the replica dropped (idle or LRU) since it started
    failures: int = 0  # times the pool saw this replica die
    routed_total: int = 0  # sessions ever routed to this replica


class Backend(Protocol):
    """The verifier side of the front door."""

    info: ModelInfo  # valid once start() returned

    async def start(self) -> None:
        """Load models; the front door reports SERVING only after this returns."""

    async def stop(self) -> None:
        """Release replicas."""

    async def open_session(self, spec: SessionSpec) -> int:
        """Open or re-open a session; returns its committed length."""

    async def verify(self, block: DraftBlock) -> VerifyResult:
        """Verify one round on the replica that owns the session."""

    async def close_session(self, session_id: str) -> bool:
        """Free a session; True if it existed."""

    async def status(self) -> list[ReplicaStatus]:
        """Per-replica state for the metrics."""


class InProcessBackend:
    """One Verifier in this process, with the same round batching as a Ray replica."""

    def __init__(self, verifier: Verifier, max_batch: int = 16, max_wait_ms: float = 2.0) -> None:
        self.verifier = verifier
        self.info = verifier.info
        self._batcher = RoundBatcher(verifier.verify_batch, max_batch, max_wait_ms)

    async def start(self) -> None:
        """Nothing to load: the verifier came loaded."""

    async def stop(self) -> None:
        """Stop batching."""
        await self._batcher.close()

    async def open_session(self, spec: SessionSpec) -> int:
        """Prefill runs in a worker thread so the event loop stays free."""
        return await asyncio.to_thread(self.verifier.open_session, spec)

    async def verify(self, block: DraftBlock) -> VerifyResult:
        """Queue the round for the next batch."""
        return await self._batcher.submit(block)

    async def close_session(self, session_id: str) -> bool:
        """Drop the session's cache."""
        return await asyncio.to_thread(self.verifier.close_session, session_id)

    async def status(self) -> list[ReplicaStatus]:
        """The single in-process verifier."""
        s = self.verifier.stats()
        return [ReplicaStatus("in-process", True, s.sessions, s.cached_tokens, s.evictions)]


async def generate_tokens(backend: Backend, spec: GenerateSpec) -> AsyncIterator[int]:
    """Cloud-only decoding: the target alone, one token per round of an empty draft.

    Every token is the 'bonus' of an empty block, so cloud-only streams are batched with the
    verification rounds of other sessions, and a lost replica is recovered from the tokens so far.
    """
    info = backend.info
    spec.validate(info.vocab_size)
    if len(spec.prompt_ids) + spec.max_new_tokens > info.max_context:
        raise ResourceExhausted(f"prompt + max_new_tokens exceeds max_context {info.max_context}")
    mode = Mode.GREEDY if spec.sampling.greedy else Mode.SPECULATIVE
    session = SessionSpec(session_id=f"generate-{uuid.uuid4().hex}", committed_ids=tuple(spec.prompt_ids),
                          sampling=spec.sampling, mode=mode, seed=spec.seed,
                          tokenizer_fingerprint=spec.tokenizer_fingerprint)
    committed = list(spec.prompt_ids)
    await backend.open_session(session)
    eos = set(info.eos_token_ids)
    try:
        for round_index in range(spec.max_new_tokens):
            block = DraftBlock(session.session_id, round_index, len(committed), ())
            try:
                result = await backend.verify(block)
            except FailedPrecondition:
                await backend.open_session(replace(session, committed_ids=tuple(committed), next_round=round_index))
                result = await backend.verify(block)
            committed.append(result.next_token)
            yield result.next_token
            if result.next_token in eos:
                return
    finally:
        try:
            await backend.close_session(session.session_id)
        except HybridSpecError:
            pass  # a soft cache: the replica expires it on its own
