"""The messages edge and cloud exchange, as plain frozen dataclasses (no protobuf, no torch).

The gRPC layer converts protobuf to these (common/protocol/codec.py); the verifier core and, later, the Ray
layer only ever see these. `validate` methods turn malformed input into InvalidArgument errors that
name the field.
"""
from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

from .errors import FailedPrecondition, InvalidArgument
from .tree import check_tree, children, is_chain

PROB_SUM_TOLERANCE = 1e-3  # float32 renormalisation error stays far below this
# Below this temperature logits / T overflows float32 for ordinary logits (1e-40 gives NaN
# probabilities); above the upper bound the distribution is uniform to float precision anyway.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 1e3
MAX_SESSION_ID_CHARS = 64  # server-issued ids are far shorter; longer ones are refused unread
MAX_REPETITION_PENALTY = 10.0  # beyond this every repeated token is ruled out anyway
MAX_OPENAI_PENALTY = 2.0  # frequency and presence penalties lie in [-2, 2], as in the OpenAI API
DEFAULT_MAX_NEW_TOKENS = 128  # a generation's tokens at most, unless asked otherwise (the edge's default too)
PROGRESS_EVERY_S = 2.0  # OpenSessionStream: the server reports an open's progress at least this often


class Mode(str, Enum):
    """Which acceptance rule a session uses (docs/design.md §2)."""

    GREEDY = "greedy"  # temperature 0; lossless
    SPECULATIVE = "speculative"  # rejection sampling; lossless in distribution
    BILD = "bild"  # BiLD rollback threshold; lossy
    LENIENT = "lenient"  # lenient rejection sampling; lossy unless lenience = 1
    COUPLED = "coupled"  # Gumbel-max coupling keyed by (seed, position); lossless, drafter-invariant

    @property
    def uses_draft_probs(self) -> bool:
        """True for the rules that read q; the others get token ids only."""
        return self in (Mode.SPECULATIVE, Mode.LENIENT)

    @property
    def verifies_trees(self) -> bool:
        """True for the rules with a tree form (common/maths/tree_verification.py); BiLD, lenient: chains."""
        return self in (Mode.GREEDY, Mode.SPECULATIVE, Mode.COUPLED)

    @staticmethod
    def default_for(temperature: float) -> Mode:
        """The lossless rule for a temperature: greedy at 0, speculative sampling above."""
        return Mode.GREEDY if temperature == 0 else Mode.SPECULATIVE

    def check_temperature(self, temperature: float) -> None:
        """InvalidArgument when this rule cannot run at `temperature`."""
        if self is Mode.GREEDY and temperature != 0:
            raise InvalidArgument("mode greedy needs sampling.temperature 0")
        if self in (Mode.SPECULATIVE, Mode.LENIENT, Mode.COUPLED) and temperature == 0:
            raise InvalidArgument(f"mode {self.value} needs sampling.temperature > 0")


DEFAULT_ROLLBACK_THRESHOLD = 5.0  # BiLD α_RB in nats (BiLD's own default)
DEFAULT_LENIENCE = 1.0  # lenient rejection sampling with l = 1 is exact speculative sampling


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution, validated on construction; also EdgeConfig's `sampling` section."""

    # Each field's metadata holds its flag's help. 0 = greedy: argmax, confidence tests at temperature 1.
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature; 0 = greedy"})
    top_k: int = field(default=0, metadata={"help": "top-k truncation, applied on both sides; 0 = off"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus truncation, applied on both sides; 1 = off"})
    # Penalties act on the logits before everything above (common/maths/sampling.py `penalize`).
    repetition_penalty: float = field(default=1.0, metadata={"help": "> 1 discourages every token of the context, "
                                                                     "prompt included (both sides apply it); 1 = off"})
    frequency_penalty: float = field(default=0.0, metadata={"help": "in [-2, 2]: OpenAI's penalty per earlier "
                                                                    "occurrence in the generated text"})
    presence_penalty: float = field(default=0.0, metadata={"help": "in [-2, 2]: OpenAI's penalty for a token "
                                                                   "already in the generated text"})

    def __post_init__(self) -> None:
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise InvalidArgument(f"sampling.temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, "
                                  f"{MAX_TEMPERATURE:g}], got {self.temperature:g}")
        if self.top_k < 0:
            raise InvalidArgument(f"sampling.top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {self.top_p:g}")
        if not (0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise InvalidArgument(f"sampling.repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                                  f"got {self.repetition_penalty:g}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not (-MAX_OPENAI_PENALTY <= getattr(self, name) <= MAX_OPENAI_PENALTY):
                raise InvalidArgument(f"sampling.{name} must be in [-{MAX_OPENAI_PENALTY:g}, "
                                      f"{MAX_OPENAI_PENALTY:g}], got {getattr(self, name):g}")

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax."""
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """True when some penalty changes the logits (all neutral: the logits are used as they are)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


class FeatureFormat(str, Enum):
    """How the target's final hidden states travel back to an edge that asked for them (docs/eagle.md)."""

    NONE = "none"  # not sent (every drafter but eagle)
    INT8 = "int8"  # per vector: int8 values and one fp16 scale (value = int8 * scale)
    FP16 = "fp16"  # per vector: fp16 values

    @property
    def bytes_per_value(self) -> int:
        """Bytes of one feature value on the wire."""
        return 1 if self is FeatureFormat.INT8 else 2


@dataclass(frozen=True)
class FeatureBlock:
    """The target's final hidden states at `count` consecutive positions of a session, starting at
    position `start` (0 = the first prompt token). `data` holds them row-major, little-endian;
    `scales` one fp16 per vector for int8, empty for fp16."""

    start: int
    count: int
    dim: int
    format: FeatureFormat
    data: bytes
    scales: bytes = b""

    @property
    def nbytes(self) -> int:
        """What the vectors cost on the wire."""
        return len(self.data) + len(self.scales)

    def validate(self) -> None:
        """InvalidArgument when the byte lengths do not match the declared shape and format."""
        if self.format is FeatureFormat.NONE or self.count < 1 or self.dim < 1 or self.start < 0:
            raise InvalidArgument("features: need a format, count >= 1, dim >= 1 and start >= 0")
        if len(self.data) != self.count * self.dim * self.format.bytes_per_value:
            raise InvalidArgument(f"features: {len(self.data)} data bytes for {self.count} x {self.dim} "
                                  f"{self.format.value} values")
        scales = 2 * self.count if self.format is FeatureFormat.INT8 else 0
        if len(self.scales) != scales:
            raise InvalidArgument(f"features: {len(self.scales)} scale bytes, expected {scales}")


@dataclass(frozen=True)
class ModelInfo:
    """What a verifier serves and the limits it enforces."""

    model_name: str
    vocab_size: int
    tokenizer_fingerprint: str
    model_fingerprint: str
    max_context: int
    max_draft: int
    max_sessions: int
    idle_timeout_s: int
    eos_token_ids: tuple[int, ...] = ()
    device: str = ""  # where the target runs, e.g. "cpu" or "cuda:0"
    dtype: str = ""  # the precision it is served in; greedy output equals its own decoding in this dtype
    feature_dim: int = 0  # size of the final hidden states it can send (0: it sends none)
    # (M, milliseconds): what a forward pass of M tokens cost the replica's engine when it started,
    # M increasing; empty when not measured. The shape of t_v(γ) = cost(γ + 1) for the edge's policy.
    pass_costs: tuple[tuple[int, float], ...] = ()
    max_tree_nodes: int = 0  # most nodes of a draft tree (depth at most max_draft); 0: chains only
    # (B, M, milliseconds): passes of B sessions × M tokens each, grouped by B, M increasing in each
    # group; the cost of γ when B sessions' rounds share a pass. Empty when not measured.
    batch_pass_costs: tuple[tuple[int, int, float], ...] = ()


def check_session_id(session_id: str, *, allow_empty: bool = False) -> None:
    """InvalidArgument for an id no server could have issued (never echoing it back)."""
    if not session_id and not allow_empty:
        raise InvalidArgument("session_id must not be empty")
    if len(session_id) > MAX_SESSION_ID_CHARS:
        raise InvalidArgument(f"session_id is {len(session_id)} characters; at most {MAX_SESSION_ID_CHARS}")


@dataclass(frozen=True)
class SessionSpec:
    """Everything needed to (re-)open a session on any replica. On the wire `session_id` is empty for a new
    generation and the server-issued id to re-open one; inside the cloud it is always the front door's id."""

    session_id: str
    committed_ids: tuple[int, ...]  # prompt + committed tokens
    sampling: SamplingParams = field(default_factory=SamplingParams)
    mode: Mode = Mode.GREEDY
    seed: int = 0
    rollback_threshold: float = DEFAULT_ROLLBACK_THRESHOLD  # BiLD α_RB in nats
    lenience: float = DEFAULT_LENIENCE
    tokenizer_fingerprint: str = ""  # empty: not checked
    model_fingerprint: str = ""  # empty: not checked
    next_round: int = 0
    features: FeatureFormat = FeatureFormat.NONE  # send the target's hidden states for an eagle drafter
    # committed_ids[:prompt_len] is the prompt: frequency and presence penalties count only the tokens
    # after it. 0 (unset) = all of committed_ids is prompt, which is right for a new generation; the
    # edge sends it on every open so a re-open keeps the boundary.
    prompt_len: int = 0
    # Never on the wire: the authenticated identity the front door opened the session for ("" on a
    # server without credentials). Every round must come from the same identity.
    owner: str = ""
    # Never on the wire, set by the front door: whose share of a replica the session draws on (the
    # identity's name, a caller's address without a token) and that identity's weight.
    tenant: str = ""
    weight: float = 1.0

    @property
    def prompt_end(self) -> int:
        """Where the prompt ends in committed_ids (prompt_len, with 0 resolved)."""
        return self.prompt_len or len(self.committed_ids)

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidArgument naming the first bad field."""
        check_session_id(self.session_id)
        if not self.committed_ids:
            raise InvalidArgument("committed_ids must hold at least one token")
        _check_ids("committed_ids", self.committed_ids, vocab_size)
        _check_prompt_len(self.prompt_len, self.committed_ids, "committed_ids")
        self.mode.check_temperature(self.sampling.temperature)
        if not (0.0 < self.lenience <= 1.0):
            raise InvalidArgument(f"lenience must be in (0, 1], got {self.lenience:g}")
        if not (0.0 < self.rollback_threshold < math.inf):
            raise InvalidArgument(f"rollback_threshold must be finite and > 0, got {self.rollback_threshold:g}")

    def check_against(self, info: ModelInfo) -> None:
        """Everything a server checks before it touches any state for this open: the fields, the
        fingerprints the edge expects, and the context limit."""
        self.validate(info.vocab_size)
        if self.tokenizer_fingerprint and self.tokenizer_fingerprint != info.tokenizer_fingerprint:
            raise FailedPrecondition(f"tokenizer fingerprint mismatch: edge has {self.tokenizer_fingerprint[:64]}, "
                                     f"verifier has {info.tokenizer_fingerprint}")
        if self.model_fingerprint and self.model_fingerprint != info.model_fingerprint:
            raise FailedPrecondition(f"model fingerprint mismatch: edge expects {self.model_fingerprint[:64]}, "
                                     f"verifier serves {info.model_fingerprint}")
        if len(self.committed_ids) >= info.max_context:
            raise InvalidArgument(f"committed_ids holds {len(self.committed_ids)} tokens; this verifier's "
                                  f"max_context is {info.max_context}")


@dataclass(frozen=True)
class SessionOpened:
    """The answer to OpenSession: the id every later call of the session carries, its length, and
    where its rounds go ("" = the front door that opened it; else its replica's own endpoint)."""

    session_id: str
    committed_len: int
    verify_address: str = ""
    features: FeatureBlock | None = None  # asked-for features of committed_ids[:-1] (all but the last)


@dataclass(frozen=True)
class OpenProgress:
    """How far an open has got: `cached` of its `total` prompt tokens are in the verifier's cache
    (total = len(committed_ids) - 1: the newest token is cached by the first round)."""

    cached: int
    total: int


async def opened_from(items: AsyncIterator[OpenProgress | SessionOpened],
                      progress: Callable[[OpenProgress], None] | None = None) -> SessionOpened:
    """The answer an open's stream of progress ends with (read to its end, which raises the open's error),
    each OpenProgress before it told to `progress`."""
    opened = None
    async for item in items:
        if isinstance(item, SessionOpened):
            opened = item
        elif progress is not None:
            progress(item)
    return opened


@dataclass(frozen=True)
class DraftBlock:
    """One round's draft: a chain, or a tree when `parents` is given (common/protocol/tree.py). At
    temperature 0, support_ids and probs are empty (q is one-hot). In a tree each node carries the q
    of its parent, which it was drawn from: siblings carry the same one."""

    session_id: str
    round: int
    committed_len: int
    draft_ids: tuple[int, ...]
    support_ids: tuple[tuple[int, ...], ...] = ()  # per draft position, the support of q
    probs: tuple[tuple[float, ...], ...] = ()  # per draft position, q over that support
    parents: tuple[int, ...] = ()  # per node, its parent (-1: the newest committed token); () = a chain
    # Never on the wire: the authenticated identity that sent the block, set by the server that took it
    # ("" on a server without credentials); the session's owner must match.
    owner: str = ""

    @cached_property  # asked at every step of a round's way (plan, validation, rule, KV kept): derived once
    def is_tree(self) -> bool:
        """True when `parents` makes the draft anything but a chain."""
        return bool(self.parents) and not is_chain(self.parents)

    def validate(self, vocab_size: int, max_draft: int, needs_probs: bool, max_tree_nodes: int = 0,
                 trees: bool = True) -> None:
        """Raise InvalidArgument naming the first bad field. max_tree_nodes: the server's node limit
        for trees (0: chains only); trees: whether the session's rule verifies trees. Not the session
        id: the servicer checks it before any lookup, and a block is validated once its session is found."""
        gamma = len(self.draft_ids)
        if self.parents:
            check_tree(self.parents, self.draft_ids, max(max_tree_nodes, max_draft), max_draft)
            if self.is_tree and not max_tree_nodes:
                raise InvalidArgument("this server verifies chains only: send draft_parents empty")
            if self.is_tree and not trees:
                raise InvalidArgument("this session's mode verifies chains only: send draft_parents empty")
        elif gamma > max_draft:
            raise InvalidArgument(f"draft_ids holds {gamma} tokens; this server allows at most {max_draft}")
        _check_ids("draft_ids", self.draft_ids, vocab_size)
        if not needs_probs:
            if self.support_ids or self.probs:
                raise InvalidArgument("draft_probs must be empty: this session's mode reads token ids only")
            return
        if len(self.support_ids) != gamma or len(self.probs) != gamma:
            raise InvalidArgument(
                f"draft_probs has {len(self.support_ids)} positions for {gamma} draft_ids; they must match")
        for i, (ids, ps, x) in enumerate(zip(self.support_ids, self.probs, self.draft_ids)):
            where = f"draft_probs[{i}]"
            if len(ids) != len(ps):
                raise InvalidArgument(f"{where}: {len(ids)} support_ids but {len(ps)} probs")
            _check_ids(f"{where}.support_ids", ids, vocab_size)
            if len(set(ids)) != len(ids):
                raise InvalidArgument(f"{where}.support_ids has repeated ids")
            if not all(0.0 < p <= 1.0 for p in ps):
                raise InvalidArgument(f"{where}.probs must all be in (0, 1]")
            total = math.fsum(ps)
            if abs(total - 1.0) > PROB_SUM_TOLERANCE:
                raise InvalidArgument(f"{where}.probs sum to {total:.6f}, not 1")
            if x not in ids:
                raise InvalidArgument(f"{where}.support_ids does not contain the draft token {x}")
        if self.is_tree:
            for siblings in children(self.parents):
                first = siblings[0] if siblings else None
                for i in siblings[1:]:
                    if self.support_ids[i] != self.support_ids[first] or self.probs[i] != self.probs[first]:
                        raise InvalidArgument(f"draft_probs[{i}] differs from draft_probs[{first}]: siblings "
                                              "are drawn from one q and must carry it alike")


@dataclass(frozen=True)
class VerifyResult:
    """The verifier's answer to one round."""

    round: int
    num_accepted: int
    next_token: int
    committed_len: int
    # Set by the replica's step alone (cloud/core/verifier.py): from the round's arrival in its queue
    # to its answer, queueing + the step.
    verify_ms: float = 0.0
    batch_size: int = 1  # rounds scored in the same forward pass
    queue_ms: float = 0.0  # of verify_ms, the wait before the step that carried the round began
    features: FeatureBlock | None = None  # asked-for features of the last committed token + accepted drafts
    accepted_path: tuple[int, ...] = ()  # a tree's accepted nodes from depth 1 down; () for a chain

    def timed(self, verify_ms: float, queue_ms: float) -> VerifyResult:
        """This answer with the replica's timings: `dataclasses.replace` of the two fields at a fifth of its
        cost (a step times every round it answers, 64 and more at a time)."""
        out = object.__new__(VerifyResult)
        out.__dict__.update(self.__dict__, verify_ms=verify_ms, queue_ms=queue_ms)
        return out


@dataclass(frozen=True)
class GenerateSpec:
    """A cloud-only generation request."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    seed: int = 0
    tokenizer_fingerprint: str = ""
    # prompt_ids[:prompt_len] is the user's prompt, the rest what was generated before this stream
    # (an edge handing over to the cloud); 0 (unset) = all of prompt_ids is prompt.
    prompt_len: int = 0

    @property
    def prompt_end(self) -> int:
        """Where the prompt ends in prompt_ids (prompt_len, with 0 resolved)."""
        return self.prompt_len or len(self.prompt_ids)

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidArgument naming the first bad field."""
        if not self.prompt_ids:
            raise InvalidArgument("prompt_ids must hold at least one token")
        _check_ids("prompt_ids", self.prompt_ids, vocab_size)
        _check_prompt_len(self.prompt_len, self.prompt_ids, "prompt_ids")
        if self.max_new_tokens < 1:
            raise InvalidArgument("max_new_tokens must be >= 1")


@dataclass(frozen=True)
class DecodeSpec:
    """Cloud-only decoding on an open session: up to `max_new_tokens` tokens after its committed ones,
    each the token of an empty round."""

    session_id: str
    round: int  # the session's next round
    committed_len: int  # the committed length the client believes in
    max_new_tokens: int

    def validate(self, max_context: int) -> None:
        """Raise InvalidArgument naming the first bad field."""
        check_session_id(self.session_id)
        if self.max_new_tokens < 1:
            raise InvalidArgument("max_new_tokens must be >= 1")
        if self.committed_len + self.max_new_tokens > max_context:
            raise InvalidArgument(f"committed_len ({self.committed_len}) plus max_new_tokens ({self.max_new_tokens}) "
                                  f"exceeds the verifier's max_context of {max_context} tokens")


def check_context(prompt_tokens: int, max_new_tokens: int, max_context: int) -> None:
    """InvalidArgument, naming the numbers, when a prompt and the tokens to generate after it do not fit
    in a session's max_context (0: not known, nothing to check): what the cloud's Generate and an edge
    check before any work."""
    if max_context and prompt_tokens >= max_context:
        raise InvalidArgument(f"the prompt is {prompt_tokens} tokens; the verifier's max_context is {max_context}")
    if max_context and prompt_tokens + max_new_tokens > max_context:
        raise InvalidArgument(f"the prompt ({prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
                              f"the verifier's max_context of {max_context} tokens")


def _check_ids(name: str, ids: tuple[int, ...], vocab_size: int) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidArgument(f"{name}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")


def _check_prompt_len(prompt_len: int, ids: tuple[int, ...], name: str) -> None:
    """InvalidArgument unless 0 <= prompt_len <= len(ids) (0: all of `ids` is prompt)."""
    if not 0 <= prompt_len <= len(ids):
        raise InvalidArgument(f"prompt_len must be in [0, len({name})] = [0, {len(ids)}], got {prompt_len}")
