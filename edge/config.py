"""The edge worker's configuration: defaults, then a YAML file, then CLI flags."""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, replace
from pathlib import Path

from ..common.config import Choice, ConfigError, choice
from ..common.protocol.channel import DEFAULT_CLOUD_ADDRESS
from ..common.security.credentials import MAX_TOKEN_CHARS
from ..common.security.tls import ClientTLS, is_loopback
from ..common.protocol.wire import DEFAULT_LENIENCE, DEFAULT_ROLLBACK_THRESHOLD, FeatureFormat, Mode, SamplingParams
from .proposal import DraftSettings, DrafterKind



class GammaPolicy(Choice):
    """How long a block to draft."""

    ADAPTIVE = "adaptive"  # γ each round for the most tokens/s, from measured rates
    FIXED = "fixed"  # always max_draft


class WireFeatures(Choice):
    """How the verifier sends the target's features to an eagle head (FeatureFormat's two encodings)."""

    INT8 = FeatureFormat.INT8.value
    FP16 = FeatureFormat.FP16.value
MAX_STOP_STRINGS = 16  # stop strings per generation (OpenAI allows 4)
MAX_STOP_CHARS = 256  # characters per stop string
TOKEN_ENV = "HYBRIDSPEC_TOKEN"  # the edge's token when no token_file is given


@dataclass(frozen=True)
class CloudAccess:
    """How an edge reaches its cloud: TLS settings and the bearer token every call carries (None: none)."""

    tls: ClientTLS = ClientTLS()
    token: str | None = None


@dataclass(frozen=True)
class EdgeConfig:
    """Every knob of `hybridspec edge generate`. Empty drafter means the embedded default."""

    cloud: str = DEFAULT_CLOUD_ADDRESS  # HOST:PORT of the verifier pool's front door
    drafter: str = ""  # model directory, .gguf file, cached hub id, embedded:plain or embedded:eagle; "" = default
    drafter_kind: DrafterKind = DrafterKind.MODEL  # model = the drafter checkpoint (an LM or an eagle head); ngram = prompt lookup
    features: WireFeatures = WireFeatures.INT8  # eagle heads: how the verifier sends the target's features (int8 | fp16)
    fallback_drafter: str = ""  # eagle heads, without features: "" = the embedded plain drafter, ngram, or a path
    ngram_max: int = 3  # ngram: longest suffix looked up in the context
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    torch_threads: int = 0  # intra-op threads on CPU; 0 keeps torch's default
    max_new_tokens: int = 128  # generation stops after this many tokens or an end-of-sequence token
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # > 1 discourages every token of the context (prompt included); 1 = off
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted once per earlier occurrence in the generated text
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once if the token occurs in the generated text
    stop: tuple[str, ...] = ()  # generation ends before the first of these strings; it is not returned
    # A seed asks for reproducible text: sampling then uses the coupled rule, whose output depends only on
    # (prompt, seed). None: a fresh seed per generation and standard rejection sampling (docs/design.md §2.2).
    seed: int | None = None
    mode: str = ""  # greedy | speculative | bild | lenient | coupled; "" = greedy at T=0, else speculative
    max_draft: int = 8  # γ cap: most tokens drafted per round (also capped by the server's limit)
    gamma_policy: GammaPolicy = GammaPolicy.ADAPTIVE  # adaptive = pick γ each round for the most tokens/s; fixed = max_draft
    fallback_threshold: float = 0.6  # BiLD α_FB: end the block when the drafter's max q falls below this
    keep_low_confidence: bool = True  # send the token that triggered α_FB (HF) or drop it (BiLD)
    rollback_threshold: float = DEFAULT_ROLLBACK_THRESHOLD  # BiLD α_RB in nats, mode bild only
    lenience: float = DEFAULT_LENIENCE  # mode lenient only, in (0, 1]
    wire_top_k: int = 64  # q is truncated to this many tokens before sampling and sending; 0 = full
    pipeline: bool = True  # draft the next block while the current one is being verified
    cloud_only_switch: bool = True  # let the cloud decode alone while that is predicted to be faster
    cloud_only: bool = False  # the baseline: the cloud decodes every token alone, the drafter never runs
    probe_tokens: int = 32  # while cloud-only: tokens per stream before measuring and deciding again
    allow_unverified: bool = False  # cloud unreachable: keep generating with the drafter alone, marked
    reconnect_s: float = 1.0  # offline: seconds between attempts to reach the cloud again
    timeout_s: float = 30.0  # no reply within this long = the cloud is unreachable
    tls: bool = False  # speak TLS to the cloud (implied by tls_ca and tls_cert)
    tls_ca: str = ""  # PEM CA bundle the cloud's certificate must chain to; "" = the system's roots
    tls_cert: str = ""  # PEM client certificate, for a cloud that requires mutual TLS (with tls_key)
    tls_key: str = ""  # its private key
    tls_server_name: str = ""  # the name the cloud's certificate must carry; "" = the host in `cloud`
    token_file: str = ""  # file holding this edge's token; "" = the HYBRIDSPEC_TOKEN variable, if set
    insecure: bool = False  # allow sending the token in plaintext to a cloud that is not on loopback

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {self.max_draft}")
        if not 0.0 <= self.fallback_threshold <= 1.0:
            raise ValueError(f"fallback_threshold must be in [0, 1], got {self.fallback_threshold}")
        for name in ("wire_top_k", "probe_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if len(self.stop) > MAX_STOP_STRINGS or not all(0 < len(x) <= MAX_STOP_CHARS for x in self.stop):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most "
                             f"{MAX_STOP_CHARS} characters")
        if self.ngram_max < 1:
            raise ValueError(f"ngram_max must be >= 1, got {self.ngram_max}")
        if not (self.timeout_s > 0 and self.reconnect_s > 0):
            raise ValueError("timeout_s and reconnect_s must be > 0")
        for name, kind in (("drafter_kind", DrafterKind), ("features", WireFeatures), ("gamma_policy", GammaPolicy)):
            object.__setattr__(self, name, choice(kind, getattr(self, name), name))
        if self.mode and self.mode not in {m.value for m in Mode}:
            raise ValueError(f"mode must be one of {', '.join(m.value for m in Mode)}, got {self.mode!r}")
        self.sampling  # validates temperature, top_k, top_p and the penalties
        self.resolved_mode.check_temperature(self.temperature)
        self.client_tls  # tls_cert and tls_key go together

    @property
    def client_tls(self) -> ClientTLS:
        """TLS towards the cloud (disabled unless asked for)."""
        return ClientTLS(enabled=self.tls or bool(self.tls_ca or self.tls_cert), ca=self.tls_ca, cert=self.tls_cert,
                         key=self.tls_key, server_name=self.tls_server_name)

    def cloud_access(self) -> CloudAccess:
        """TLS and the token (read now from token_file or $HYBRIDSPEC_TOKEN). ConfigError for a token
        that cannot be read, or one that would cross the network in plaintext without `insecure`."""
        token = None
        if self.token_file:
            try:
                token = Path(self.token_file).read_text().strip()
            except OSError as exc:
                raise ConfigError(f"token_file {self.token_file} cannot be read: {exc.strerror or exc}") from None
            if not token:
                raise ConfigError(f"token_file {self.token_file} is empty")
        elif os.environ.get(TOKEN_ENV):
            token = os.environ[TOKEN_ENV].strip()
        if token is not None and (len(token) > MAX_TOKEN_CHARS or not token.isprintable() or " " in token):
            raise ConfigError(f"the token must be one word of at most {MAX_TOKEN_CHARS} printable characters")
        tls = self.client_tls
        host = self.cloud.rsplit(":", 1)[0]
        if token is not None and not tls.enabled and not is_loopback(host) and not self.insecure:
            raise ConfigError(f"the token would cross the network to {self.cloud} in plaintext: use TLS (--tls, "
                              "--tls-ca) or pass --insecure")
        return CloudAccess(tls, token)

    @property
    def sampling(self) -> SamplingParams:
        """The sampling transform shared with the verifier."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty)

    def draft_settings(self, vocab_size: int, stop_ids: frozenset[int], prompt_len: int = 0) -> DraftSettings:
        """How this config drafts against a target with this vocabulary and these stop ids, after a
        prompt of `prompt_len` tokens (0: all of the first context drafted after)."""
        return DraftSettings(sampling=self.sampling, vocab_size=vocab_size, stop_ids=stop_ids,
                             fallback_threshold=self.fallback_threshold, keep_low_confidence=self.keep_low_confidence,
                             wire_top_k=self.wire_top_k, seed=self.resolved().seed, ngram_max=self.ngram_max,
                             prompt_len=prompt_len, coupled=self.resolved_mode is Mode.COUPLED)

    @property
    def resolved_mode(self) -> Mode:
        """The acceptance rule: the explicit mode, else greedy at T=0; when sampling, coupled if a seed
        was given (the same text for the same seed), else speculative (more tokens accepted)."""
        if self.mode:
            return Mode(self.mode)
        if self.temperature > 0 and self.seed is not None:
            return Mode.COUPLED
        return Mode.default_for(self.temperature)

    def resolved(self) -> EdgeConfig:
        """This config with its rule named and a seed drawn if none was given: one generation's settings."""
        if self.seed is not None and self.mode:
            return self
        seed = self.seed if self.seed is not None else secrets.randbits(63)
        return replace(self, seed=seed, mode=self.resolved_mode.value)
