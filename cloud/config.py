"""The verifier server's configuration (deploy/*.yaml holds ready-made ones)."""
from __future__ import annotations

from dataclasses import dataclass

from .verifier import VerifierLimits


@dataclass(frozen=True)
class ServeConfig:
    """Everything `hybridspec cloud serve` needs. Empty target means the embedded default."""

    target: str = ""  # model directory, .gguf file or cached hub id; "" = embedded default
    host: str = "127.0.0.1"  # interface to bind; 0.0.0.0 to serve other hosts
    port: int = 50051  # 0 picks a free port
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    torch_threads: int = 0  # intra-op threads on CPU; 0 keeps torch's default
    max_context: int = 4096  # committed + draft tokens per session
    max_draft: int = 32  # longest draft block accepted
    max_sessions: int = 64  # sessions held at once; more get RESOURCE_EXHAUSTED
    idle_timeout_s: int = 600  # idle sessions are dropped after this
    grace_s: float = 5.0  # on SIGTERM/SIGINT, in-flight calls get this long to finish

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_context", "max_draft", "max_sessions", "idle_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def limits(self) -> VerifierLimits:
        """The per-session limits the verifier enforces."""
        return VerifierLimits(max_context=self.max_context, max_draft=self.max_draft,
                              max_sessions=self.max_sessions, idle_timeout_s=self.idle_timeout_s)
