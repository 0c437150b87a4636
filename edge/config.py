"""The edge worker's configuration: defaults, then a YAML file, then CLI flags."""
from __future__ import annotations

from dataclasses import dataclass

from ..common.wire import Mode, SamplingParams


@dataclass(frozen=True)
class EdgeConfig:
    """Every knob of `hybridspec edge generate`. Empty drafter means the embedded default."""

    cloud: str = "127.0.0.1:50051"  # HOST:PORT of the verifier
    drafter: str = ""  # model directory, .gguf file or cached hub id; "" = embedded default
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    torch_threads: int = 0  # intra-op threads on CPU; 0 keeps torch's default
    max_new_tokens: int = 128  # generation stops after this many tokens or an end-of-sequence token
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0  # seeds the drafter's sampling and the verifier's
    mode: str = ""  # greedy | speculative | bild | lenient; "" = greedy at T=0, else speculative
    max_draft: int = 8  # γ: most tokens drafted per round (also capped by the server's limit)
    fallback_threshold: float = 0.6  # BiLD α_FB: end the block after a token drafted with max q below this
    rollback_threshold: float = 5.0  # BiLD α_RB in nats, mode bild only
    lenience: float = 1.0  # mode lenient only, in (0, 1]
    wire_top_k: int = 64  # q is truncated to this many tokens before sampling and sending; 0 = full
    timeout_s: float = 30.0  # deadline for unary calls to the cloud

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_draft < 0:
            raise ValueError(f"max_draft must be >= 0, got {self.max_draft}")
        if not 0.0 <= self.fallback_threshold <= 1.0:
            raise ValueError(f"fallback_threshold must be in [0, 1], got {self.fallback_threshold}")
        if self.wire_top_k < 0:
            raise ValueError(f"wire_top_k must be >= 0, got {self.wire_top_k}")
        if self.mode and self.mode not in {m.value for m in Mode}:
            raise ValueError(f"mode must be one of {', '.join(m.value for m in Mode)}, got {self.mode!r}")
        self.sampling  # validates temperature, top_k, top_p
        if self.resolved_mode is Mode.GREEDY and self.temperature != 0:
            raise ValueError("mode greedy needs temperature 0")
        if self.resolved_mode in (Mode.SPECULATIVE, Mode.LENIENT) and self.temperature == 0:
            raise ValueError(f"mode {self.mode} needs temperature > 0")

    @property
    def sampling(self) -> SamplingParams:
        """The sampling transform shared with the verifier."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    @property
    def resolved_mode(self) -> Mode:
        """The acceptance rule: the explicit mode, else greedy at T=0 and speculative otherwise."""
        if self.mode:
            return Mode(self.mode)
        return Mode.GREEDY if self.temperature == 0 else Mode.SPECULATIVE
