"""What the serving core needs from an inference engine, and nothing more.

The core (cloud/core/) decides what a forward pass carries and applies the verification rules to
the scores it returns; an engine runs the pass and owns the KV cache behind it. The core sees a
session's cache only as an opaque `KVSequence` handle whose `length` is the number of tokens cached:
it asks the engine for room, feeds tokens, cuts a rejected suffix off, starts a new session from
another's cached prefix, and releases the handle when the session ends. Any engine that implements `Engine` (today's torch engine, cloud/engine/torch_engine.py;
the llama.cpp engine, cloud/engine/llamacpp_engine.py) serves every rule, mode and session feature the core offers.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:  # tensors only pass through here: a process that serves no model never imports torch
    import torch


class KVSequence(Protocol):
    """One session's cache inside an engine; only the engine changes it."""

    @property
    def length(self) -> int:
        """Tokens whose keys and values are cached."""


class KVLimits(Protocol):
    """The limits that size an engine's KV cache (cloud/core/limits.py VerifierLimits has them): the
    engine reads them, the core owns them."""

    max_context: int  # tokens one session may cache
    max_sessions: int  # sessions one replica holds
    max_tree_nodes: int  # 0: chains only
    kv_cache_tokens: int  # everything the sessions cache, together
    kv_streams: int  # llama.cpp: sessions resident at once


class Feed(NamedTuple):
    """Tokens to append to one session's cache in a pass. (A tuple: a pass makes one per session, 64 and
    more, and a frozen dataclass costs five times as much to make.)"""

    kv: KVSequence  # the session's cache; the engine was asked for room for the tokens beforehand
    tokens: Sequence[int]
    scored: bool  # True: logits at every fed position (a round); False: a prefill chunk, no logits
    features: bool = False  # True: also the final hidden states at every fed position
    # A draft tree (common/protocol/tree.py `feed_parents`): token j's parent among the fed tokens,
    # -1 for the first (it follows the cached context). Token j sits at position length + its depth
    # and attends to the cache, its ancestors and itself only. None: a chain, every token after the last.
    parents: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Scores:
    """What a pass computed for one feed."""

    logits: torch.Tensor | None  # float32 [len(tokens), V] on the engine's device if the feed is scored
    hidden: torch.Tensor | None  # [len(tokens), H] final hidden states (after the final norm, the
    #                              output head's input) if the feed asked
    # Where `logits` lie in the pass's own logits, if they are the rows `rows` of one tensor that every
    # feed of the pass shares (a torch engine's pass): a pass's rules then read them all at once.
    in_pass: torch.Tensor | None = None
    rows: slice | None = None


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, so the core refuses what it cannot before any state changes."""

    name: str  # e.g. "torch"
    device: str  # where the weights live, e.g. "cpu", "cuda:0"
    dtype: str  # the weights' type, e.g. "float32", "bfloat16", "Q4_1"
    feature_dim: int  # size of a final hidden state (0: the engine cannot return features)
    tree_masks: bool = False  # can score a draft tree (a feed with parents) in one pass
    max_tree_leaves: int = 0  # leaves of all trees in one pass at most (0: no limit); the core defers the rest
    max_trees: int = 0  # trees in one pass at most (0: no limit); the core defers the rest
    max_sequence_tokens: int = 0  # most tokens one session may cache (0: only the whole cache bounds it)
    max_sequences_per_pass: int = 0  # sessions one pass may feed at most (0: no limit); the core defers the rest


class Target(Protocol):
    """What the core reports about the model an engine serves (a LoadedModel for the torch engine,
    a GgufTarget for llama.cpp)."""

    name: str
    tokenizer: Any  # a transformers tokenizer: its fingerprint is what edges must match

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def fingerprint(self) -> str: ...


class Engine(Protocol):
    """A target model bound to a bounded KV cache, scoring many sessions' feeds in one pass."""

    capabilities: Capabilities
    # What besides the model and the capabilities makes a pass cost what it does (threads, library
    # version, batch sizes), JSON-able; None when the engine cannot say (its pass-cost curve is then
    # never kept on disk: cloud/core/cost_cache.py).
    pass_settings: dict | None

    @property
    def capacity_tokens(self) -> int:
        """Tokens the KV cache holds in all."""

    def fill(self) -> float:
        """The fraction of the KV cache in use, in [0, 1]."""

    def new_sequence(self) -> KVSequence:
        """An empty cache for a new session (takes no memory until it grows)."""

    def fits(self, kv: KVSequence, extra: int) -> bool:
        """True if `extra` more tokens of `kv` fit in the free cache right now."""

    def reserve(self, kv: KVSequence, extra: int) -> None:
        """Room for `extra` more tokens of `kv`; ResourceExhausted (nothing taken) if they do not fit."""

    def forward(self, feeds: Sequence[Feed]) -> list[Scores]:
        """Append every feed's tokens to its cache in one pass; per feed, its Scores.

        Each cache grows by its feed's tokens only if the pass succeeds; on an exception no cache
        changed length (the rows written hold nothing any length covers).
        """

    def copy_prefix(self, src: KVSequence, dst: KVSequence, length: int) -> None:
        """Make the empty `dst` (from new_sequence) start from `src`'s first `length` cached tokens: their
        keys and values as `src` holds them, so a pass over `dst` then scores exactly as if `dst` had
        been fed those tokens itself. Takes the room `length` tokens need, as `reserve` does (check with
        `fits(dst, length)`; ResourceExhausted, taking nothing, if it is not there); `src` keeps its
        length and contents. ValueError if `dst` is not empty or `length` is not in [1, src.length]."""

    def truncate(self, kv: KVSequence, length: int) -> None:
        """Keep the first `length` cached tokens of `kv` (a rejected suffix, a failed round)."""

    def keep_rows(self, kv: KVSequence, start: int, rows: Sequence[int]) -> None:
        """After a tree pass: keep the tokens fed at `start + rows[i]` (increasing, rows[0] = 0: the
        accepted root path) as tokens `start + i`, and drop everything after them. Their keys were
        computed at the positions they now hold, so only storage moves. For a chain this is truncate."""

    def release(self, kv: KVSequence) -> None:
        """Give back everything `kv` holds; the handle is empty afterwards."""


@runtime_checkable
class Parking(Protocol):
    """What an engine that keeps only some sessions' caches in its fast memory (llama.cpp's streams) and
    parks the others tells the core, and what the core tells it, so that the core's policy decides who
    is served from a stream (cloud/core/passes.py `stream_rounds`) and who is parked first."""

    # When the engine must park an idle session to free a stream: the one of least rank, then the least
    # recently used. The core sets it (default: every rank 0, least recently used alone).
    park_rank: Callable[[KVSequence], float]

    def resident_since(self, kv: KVSequence) -> float | None:
        """When `kv` last took a stream (time.monotonic()); None while it has none (parked or empty)."""
