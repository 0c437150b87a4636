"""A verifier replica as a Ray actor: one target model on its device, its sessions, its batcher.

The actor speaks the wire dataclasses (Ray pickles them); it never sees protobuf. Domain errors are
returned as values rather than raised, so the pool gets the error itself instead of Ray's wrapped
traceback, and a raised exception always means the replica itself failed.
"""
from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from ..common.errors import HybridSpecError
from ..common.wire import DraftBlock, ModelInfo, SessionSpec, VerifyResult
from .scheduler import DEFAULT_MAX_BATCH, DEFAULT_MAX_WAIT_MS
from .runner import VerifierRunner
from .verifier import Verifier, VerifierLimits, VerifierStats

T = TypeVar("T")


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica loads and how it batches."""

    target: str  # model directory, .gguf file or cached hub id (resolved by the caller)
    device: str = "auto"
    dtype: str = "auto"
    torch_threads: int = 0  # CPU intra-op threads; 0 keeps torch's default
    limits: VerifierLimits = VerifierLimits()
    max_batch: int = DEFAULT_MAX_BATCH
    max_wait_ms: float = DEFAULT_MAX_WAIT_MS


class VerifierReplica:
    """Ray actor class (the pool applies ray.remote with its resources)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        import torch

        from ..common.models import load_model

        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        verifier = Verifier(load_model(spec.target, spec.device, spec.dtype), spec.limits)
        self.runner = VerifierRunner(verifier, spec.max_batch, spec.max_wait_ms)

    async def ready(self) -> ModelInfo:
        """Answers once the model is loaded (the constructor has run)."""
        return self.runner.verifier.info

    async def open_session(self, spec: SessionSpec) -> int | HybridSpecError:
        """Open or re-open a session."""
        return await _as_value(self.runner.open_session(spec))

    async def verify(self, block: DraftBlock) -> VerifyResult | HybridSpecError:
        """Verify one round in the next batch."""
        return await _as_value(self.runner.verify(block))

    async def close_session(self, session_id: str) -> bool | HybridSpecError:
        """Free a session."""
        return await _as_value(self.runner.close_session(session_id))

    async def stats(self) -> VerifierStats | HybridSpecError:
        """Sessions, cached tokens, evictions and the ids held."""
        return await _as_value(self.runner.stats())


async def _as_value(call: Awaitable[T]) -> T | HybridSpecError:
    """The call's result, or the domain error it raised (the runner raises no other kind)."""
    try:
        return await call
    except HybridSpecError as exc:
        return exc
