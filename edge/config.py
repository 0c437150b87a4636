"""The edge worker's configuration: defaults, then a YAML file, then CLI flags."""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from ..common.config import Choice, ConfigError, DType, Sections, check_fields, device_setting, setting
from ..common.models.drafter_gguf import DrafterEngine
from ..common.protocol.channel import DEFAULT_CLOUD_ADDRESS
from ..common.security.credentials import MAX_TOKEN_CHARS
from ..common.security.tls import ClientTLS, is_loopback
from ..common.protocol.wire import (DEFAULT_LENIENCE, DEFAULT_MAX_NEW_TOKENS, DEFAULT_ROLLBACK_THRESHOLD, FeatureFormat,
                                    Mode, SamplingParams)
from .controller import GammaPolicy, PolicySettings
from .proposal import DraftSettings, DrafterKind, Drafting

__all__ = ["AccessSettings", "CloudAccess", "CloudLink", "DrafterModel", "EdgeConfig", "GammaPolicy",
           "GenerationSettings", "RuleChoice", "WireFeatures"]


class RuleChoice(Choice):
    """The acceptance rule asked for: one of Mode's, or auto (decided per generation: `resolved_mode`)."""

    AUTO = "auto"  # greedy at temperature 0; when sampling, coupled with a seed, speculative without
    GREEDY = Mode.GREEDY.value
    SPECULATIVE = Mode.SPECULATIVE.value
    BILD = Mode.BILD.value
    LENIENT = Mode.LENIENT.value
    COUPLED = Mode.COUPLED.value

    @classmethod
    def _missing_(cls, value: object) -> RuleChoice | None:
        return cls.AUTO if value == "" else None  # "" was auto's spelling in config files before it had a name


class WireFeatures(Choice):
    """How the verifier sends the target's features to an eagle head (FeatureFormat's two encodings)."""

    INT8 = FeatureFormat.INT8.value
    FP16 = FeatureFormat.FP16.value


MAX_STOP_STRINGS = 16  # stop strings per generation (OpenAI allows 4)
MAX_STOP_CHARS = 256  # characters per stop string
TOKEN_ENV = "HYBRIDSPEC_TOKEN"  # the edge's token when no token_file is given
DEFAULT_TIMEOUT_S = 30.0  # no reply within this long: the cloud is unreachable (also VerifierClient's default)


@dataclass(frozen=True)
class CloudAccess:
    """How an edge reaches its cloud: TLS settings and the bearer token every call carries (None: none)."""

    tls: ClientTLS = ClientTLS()
    token: str | None = None


@dataclass(frozen=True)
class CloudLink:
    """Where the cloud is and how long to wait for it: the `link` section."""

    cloud: str = setting(DEFAULT_CLOUD_ADDRESS, "HOST:PORT of the verifier pool's front door")
    timeout_s: float = setting(DEFAULT_TIMEOUT_S, "no reply within this many seconds = the cloud is unreachable", gt=0)
    reconnect_s: float = setting(1.0, "offline: seconds between attempts to reach the cloud again", gt=0)
    allow_unverified: bool = setting(False, "if the cloud is unreachable, keep generating with the drafter "
                                            "alone, marked unverified")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class AccessSettings:
    """TLS towards the cloud and the token: the `access` section (`resolve` makes the CloudAccess)."""

    tls: bool = setting(False, "speak TLS to the cloud, trusting the system's CAs (implied by tls_ca and "
                               "tls_cert)")
    tls_ca: str = setting("", "PEM CA bundle the cloud's certificate must chain to; empty: the system's roots")
    tls_cert: str = setting("", "PEM client certificate, for a cloud that requires mutual TLS (with tls_key)")
    tls_key: str = setting("", "PEM private key of tls_cert")
    tls_server_name: str = setting("", "the name the cloud's certificate carries, if not the host dialled")
    token_file: str = setting("", f"file holding this edge's token; empty: ${TOKEN_ENV}, if set")
    insecure: bool = setting(False, "allow sending the token in plaintext to a cloud that is not on loopback")

    def __post_init__(self) -> None:
        check_fields(self)
        self.client_tls  # tls_cert and tls_key go together

    @property
    def client_tls(self) -> ClientTLS:
        """TLS towards the cloud (disabled unless asked for)."""
        return ClientTLS(enabled=self.tls or bool(self.tls_ca or self.tls_cert), ca=self.tls_ca, cert=self.tls_cert,
                         key=self.tls_key, server_name=self.tls_server_name)

    def resolve(self, cloud: str) -> CloudAccess:
        """TLS and the token (read now from token_file or $HYBRIDSPEC_TOKEN) for the cloud at `cloud`.
        ConfigError for a token that cannot be read, or one that would cross the network in plaintext
        without `insecure`."""
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
        host = cloud.rsplit(":", 1)[0]
        if token is not None and not tls.enabled and not is_loopback(host) and not self.insecure:
            raise ConfigError(f"the token would cross the network to {cloud} in plaintext: use TLS (--tls, "
                              "--tls-ca) or pass --insecure")
        return CloudAccess(tls, token)


@dataclass(frozen=True)
class DrafterModel:
    """What drafts and what runs it: the `model` section (edge/startup.py loads it)."""

    drafter: str = setting("", "drafter model directory, .gguf file, cached hub id, embedded:plain or "
                               "embedded:eagle; empty: the embedded default")
    drafter_kind: DrafterKind = setting(DrafterKind.MODEL, "model: the drafter checkpoint (an LM or an eagle "
                                                           "head); ngram: prompt lookup")
    features: WireFeatures = setting(WireFeatures.INT8, "eagle drafters: how the verifier sends the target's "
                                                        "features")
    fallback_drafter: str = setting("", "eagle drafters: what drafts while there are no features: a drafter "
                                        "path or ngram; empty: the embedded plain drafter")
    drafter_engine: DrafterEngine = setting(DrafterEngine.AUTO, "what runs a drafter LM: llamacpp runs the GGUF "
                                                                "converted beside it (`models pull` writes the "
                                                                "embedded one's); torch the checkpoint; auto = "
                                                                "llamacpp on a CPU when that GGUF is there and "
                                                                "no dtype is asked for (eagle heads: torch)")
    device: str = device_setting("where the drafter computes")
    dtype: DType = setting(DType.AUTO, "the drafter's weights; auto = float32 on a CPU, bfloat16 on a GPU")
    torch_threads: int = setting(0, "the drafter's threads on a CPU: torch's intra-op threads (0 keeps torch's "
                                    "default), or llama.cpp's (0 = 1)", ge=0)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class GenerationSettings:
    """How long a text, where it stops, its seed and the acceptance rule: the `generation` section."""

    max_new_tokens: int = setting(DEFAULT_MAX_NEW_TOKENS, "tokens to generate at most (an end-of-sequence token "
                                                          "ends sooner)", ge=1)
    stop: tuple[str, ...] = setting((), "end the text before this string (repeatable; it is not returned); "
                                        "applied to verified text only")
    # A seed asks for reproducible text: sampling then uses the coupled rule, whose output depends only on
    # (prompt, seed). None: a fresh seed per generation and standard rejection sampling (docs/design.md §2.2).
    seed: int | None = setting(None, "the same text for the same seed when sampling (coupled rule); none: a "
                                     "fresh seed per generation")
    mode: RuleChoice = setting(RuleChoice.AUTO, "acceptance rule; auto: greedy at temperature 0, else coupled "
                                                "with a seed and speculative without")
    rollback_threshold: float = setting(DEFAULT_ROLLBACK_THRESHOLD, "BiLD alpha_RB in nats (mode bild)")
    lenience: float = setting(DEFAULT_LENIENCE, "lenience in (0, 1] (mode lenient)")

    def __post_init__(self) -> None:
        check_fields(self)
        if len(self.stop) > MAX_STOP_STRINGS or not all(0 < len(x) <= MAX_STOP_CHARS for x in self.stop):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most "
                             f"{MAX_STOP_CHARS} characters")


@dataclass(frozen=True)
class EdgeConfig(Sections):
    """Every knob of `hybridspec edge generate`, by concern; each section goes whole to what uses it.
    `EdgeConfig.of(max_draft=4)` builds one from flat setting names, as flags and flat YAML keys name
    them (each name is unique across the sections)."""

    link: CloudLink = CloudLink()
    access: AccessSettings = AccessSettings()
    model: DrafterModel = DrafterModel()
    drafting: Drafting = Drafting()
    sampling: SamplingParams = SamplingParams()  # the transform shared with the verifier
    generation: GenerationSettings = GenerationSettings()
    policy: PolicySettings = PolicySettings()

    def __post_init__(self) -> None:
        self.resolved_mode.check_temperature(self.sampling.temperature)

    def cloud_access(self) -> CloudAccess:
        """TLS and the token for this config's cloud (`AccessSettings.resolve`)."""
        return self.access.resolve(self.link.cloud)

    def draft_settings(self, vocab_size: int, stop_ids: frozenset[int], prompt_len: int = 0,
                       max_context: int = 0) -> DraftSettings:
        """How this config drafts against a target with this vocabulary, these stop ids and this limit
        on a session's tokens (0: none known), after a prompt of `prompt_len` tokens (0: all of the first
        context drafted after)."""
        return DraftSettings(sampling=self.sampling, vocab_size=vocab_size, stop_ids=stop_ids, drafting=self.drafting,
                             seed=self.resolved().generation.seed, prompt_len=prompt_len,
                             coupled=self.resolved_mode is Mode.COUPLED, max_context=max_context)

    @property
    def resolved_mode(self) -> Mode:
        """The acceptance rule: the explicit mode, else greedy at T=0; when sampling, coupled if a seed
        was given (the same text for the same seed), else speculative (more tokens accepted)."""
        g = self.generation
        if g.mode is not RuleChoice.AUTO:
            return Mode(g.mode.value)
        if self.sampling.temperature > 0 and g.seed is not None:
            return Mode.COUPLED
        return Mode.default_for(self.sampling.temperature)

    def resolved(self) -> EdgeConfig:
        """This config with its rule named and a seed drawn if none was given: one generation's settings."""
        g = self.generation
        if g.seed is not None and g.mode is not RuleChoice.AUTO:
            return self
        seed = g.seed if g.seed is not None else secrets.randbits(63)
        return self.updated(seed=seed, mode=self.resolved_mode.value)
