"""A verifier replica as a Ray actor: one target model on its device, its sessions, its batcher.

The actor speaks the wire dataclasses (Ray pickles them); it never sees protobuf. Domain errors are
returned as values rather than raised, so the pool gets the error itself instead of Ray's wrapped
traceback, and a raised exception always means the replica itself failed.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..common.errors import HybridSpecError
from ..common.wire import DraftBlock, ModelInfo, SessionSpec, VerifyResult
from .batcher import RoundBatcher
from .verifier import Verifier, VerifierLimits, VerifierStats


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica loads and how it batches."""

    target: str  # model directory, .gguf file or cached hub id (resolved by the caller)
    device: str = "auto"
    dtype: str = "auto"
    torch_threads: int = 0  # CPU intra-op threads; 0 keeps torch's default
    limits: VerifierLimits = VerifierLimits()
    max_batch: int = 16
    max_wait_ms: float = 2.0


class VerifierReplica:
    """Ray actor class (the pool applies ray.remote with its resources)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        import torch

        from ..common.models import load_model

        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        self.verifier = Verifier(load_model(spec.target, spec.device, spec.dtype), spec.limits)
        self._batcher = RoundBatcher(self.verifier.verify_batch, spec.max_batch, spec.max_wait_ms)

    async def ready(self) -> ModelInfo:
        """Answers once the model is loaded (the constructor has run)."""
        return self.verifier.info

    async def open_session(self, spec: SessionSpec) -> int | HybridSpecError:
        """Open or re-open a session."""
        try:
            return await asyncio.to_thread(self.verifier.open_session, spec)
        except HybridSpecError as exc:
            return exc

    async def verify(self, block: DraftBlock) -> VerifyResult | HybridSpecError:
        """Verify one round in the next batch."""
        try:
            return await self._batcher.submit(block)
        except HybridSpecError as exc:
            return exc

    async def close_session(self, session_id: str) -> bool:
        """Free a session."""
        return await asyncio.to_thread(self.verifier.close_session, session_id)

    async def stats(self) -> VerifierStats:
        """Sessions, cached tokens, evictions."""
        return self.verifier.stats()
