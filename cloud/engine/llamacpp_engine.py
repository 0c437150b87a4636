"""The llama.cpp engine: a GGUF target served by llama.cpp's CPU kernels through llama-cpp-python's
low-level API (the high-level `Llama` class holds one sequence and an n_ctx × vocab score matrix).

One `llama_context` per engine holds the sessions' keys and values: `kv_tokens` cells split into one
stream per session (llama.cpp's per-sequence KV, `kv_unified` off), a session being a llama.cpp
sequence id. A pass is one `llama_decode` carrying every feed (rounds, decode steps, prefill chunks),
with an output row only where a rule needs logits or a session asked for features. A rejected suffix
is cut with `llama_memory_seq_rm`.

Both choices are for exactness (docs/engine.md). Flash attention is on: with it llama.cpp's CPU
kernels compute each row of a block exactly as they compute that token alone. And each session has
its own stream: the flash-attention kernel walks the cache in tiles of 64 cells, so in a cache shared
by all sessions a session's logits would depend on where its cells fall among other sessions' (a
session opened 10 cells later scores differently); in its own stream its cells always start at 0.
Then a block scored at once, alone or batched, gives the logits of the same tokens decoded one by
one, bit for bit, whatever else the replica serves (tests/test_llamacpp_engine.py). The price is a
fixed share per session: `kv_tokens / max_sequences` tokens (`Capabilities.max_sequence_tokens`).

ctypes releases the GIL during every llama.cpp call, so the replica's gRPC threads run during a pass.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp as llama
import numpy as np
import torch

from ...common.protocol.errors import ResourceExhausted
from .base import Capabilities, Feed, Scores

FTYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 15: "Q4_K_M", 17: "Q5_K_M",
          18: "Q6_K", 32: "BF16"}  # llama_ftype values of the weight types a user is likely to bring
MAX_BATCH_TOKENS = 2048  # tokens per llama_decode call; a larger pass is split (the logits are read in between)


def _quiet(level: int, text: bytes, data: ctypes.c_void_p) -> None:
    """llama.cpp's log callback: its progress chatter would drown the server's own log lines."""


_LOG_CALLBACK = llama.llama_log_callback(_quiet)  # kept alive for the process: llama.cpp holds the pointer


@dataclass(eq=False)
class LlamaSequence:
    """One session's cache: a llama.cpp sequence id (taken at the first reservation) and its length."""

    length: int = 0  # tokens cached
    held: int = 0  # cells reserved for it, >= length
    seq_id: int | None = field(default=None)


class LlamaCppEngine:
    """A GGUF model in one llama.cpp context (implements engine.base.Engine; its handles are
    LlamaSequences)."""

    def __init__(self, gguf: str | Path, kv_tokens: int, max_sequences: int, threads: int = 1,
                 flash_attention: bool = True) -> None:
        """`flash_attention` off only to measure what it buys (bench/llamacpp_engine.py): without it
        blocks are not scored exactly as single tokens (docs/engine.md)."""
        llama.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())
        llama.llama_backend_init()
        self._model = llama.llama_model_load_from_file(str(gguf).encode(), llama.llama_model_default_params())
        if not self._model:
            raise ValueError(f"llama.cpp cannot load {gguf}")
        params = llama.llama_context_default_params()
        params.n_ctx = kv_tokens
        params.n_batch = params.n_ubatch = min(kv_tokens, MAX_BATCH_TOKENS)
        params.n_seq_max = max_sequences
        params.kv_unified = False  # a stream per session: see the module's docstring
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = (llama.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attention
                                  else llama.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.pooling_type = llama.LLAMA_POOLING_TYPE_NONE  # features: one hidden state per position
        params.embeddings = False  # switched on only for passes that carry a features feed
        self._ctx = llama.llama_init_from_model(self._model, params)
        if not self._ctx:
            raise ValueError(f"llama.cpp cannot make a context of {kv_tokens} tokens for {gguf}")
        self._memory = llama.llama_get_memory(self._ctx)
        self._vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self._model))
        self._hidden = llama.llama_model_n_embd(self._model)
        self._batch_size = params.n_batch
        self._batch = llama.llama_batch_init(self._batch_size, 0, 1)
        self._capacity = kv_tokens
        self._per_sequence = llama.llama_n_ctx_seq(self._ctx)
        self._free_ids = list(range(max_sequences - 1, -1, -1))
        self._held = 0
        self._embeddings = False
        ftype = llama.llama_model_ftype(self._model)
        self.capabilities = Capabilities(name="llamacpp", device="cpu", dtype=FTYPES.get(ftype, f"ftype {ftype}"),
                                         feature_dim=self._hidden, max_sequence_tokens=self._per_sequence)

    def __del__(self) -> None:
        # The context first: it refers to the model.
        if getattr(self, "_batch", None) is not None:
            llama.llama_batch_free(self._batch)
        if getattr(self, "_ctx", None):
            llama.llama_free(self._ctx)
        if getattr(self, "_model", None):
            llama.llama_model_free(self._model)

    @property
    def vocab_size(self) -> int:
        """Rows of the output head."""
        return self._vocab

    @property
    def capacity_tokens(self) -> int:
        """Cells of the KV cache."""
        return self._capacity

    def fill(self) -> float:
        """The fraction of all cells reserved by sessions."""
        return self._held / self._capacity

    def new_sequence(self) -> LlamaSequence:
        """An empty handle; it takes a sequence id and cells when it first grows."""
        return LlamaSequence()

    def fits(self, kv: LlamaSequence, extra: int) -> bool:
        """True if `kv` has a stream, or one is free, and `extra` more tokens fit in it."""
        return kv.length + extra <= self._per_sequence and (kv.seq_id is not None or bool(self._free_ids))

    def reserve(self, kv: LlamaSequence, extra: int) -> None:
        """Take the cells `extra` more tokens need; ResourceExhausted, taking nothing, if they are not free."""
        if not self.fits(kv, extra):
            raise ResourceExhausted(f"the KV cache has no room for {extra} more tokens")
        if kv.seq_id is None:
            kv.seq_id = self._free_ids.pop()
        need = max(0, kv.length + extra - kv.held)
        kv.held += need
        self._held += need

    def truncate(self, kv: LlamaSequence, length: int) -> None:
        """Keep the first `length` tokens; the cells after them are free again."""
        if kv.seq_id is not None and length < kv.length:
            llama.llama_memory_seq_rm(self._memory, kv.seq_id, length, -1)
        kv.length = min(kv.length, length)
        self._held -= kv.held - kv.length
        kv.held = kv.length

    def release(self, kv: LlamaSequence) -> None:
        """Every cell and the sequence id back."""
        if kv.seq_id is not None:
            llama.llama_memory_seq_rm(self._memory, kv.seq_id, -1, -1)
            self._free_ids.append(kv.seq_id)
        self._held -= kv.held
        kv.length = kv.held = 0
        kv.seq_id = None

    def forward(self, feeds: Sequence[Feed]) -> list[Scores]:
        """Append every feed's tokens to its sequence in one pass (more than one llama_decode only
        when the pass exceeds MAX_BATCH_TOKENS); per feed, its Scores. On failure every sequence is
        cut back to its length before the pass."""
        for feed in feeds:
            if not feed.tokens:
                raise ValueError("every feed needs at least one token")
            if feed.kv.seq_id is None or feed.kv.held < feed.kv.length + len(feed.tokens):
                raise ValueError("reserve room for a feed's tokens before the pass")
        self._set_embeddings(any(feed.features for feed in feeds))
        # 1. Lay every token out as (feed, position in feed); a row is an output where logits or
        #    features are wanted.
        tokens = [(f, i) for f, feed in enumerate(feeds) for i in range(len(feed.tokens))]
        logits: list[list[np.ndarray]] = [[] for _ in feeds]
        hidden: list[list[np.ndarray]] = [[] for _ in feeds]
        try:
            # 2. Decode in chunks of at most one batch, reading each chunk's outputs before the next.
            for start in range(0, len(tokens), self._batch_size):
                chunk = tokens[start:start + self._batch_size]
                self._decode(feeds, chunk)
                for row, (f, _) in enumerate(chunk):
                    feed = feeds[f]
                    if feed.scored:
                        logits[f].append(_row(llama.llama_get_logits_ith(self._ctx, row), self._vocab))
                    if feed.features:
                        hidden[f].append(_row(llama.llama_get_embeddings_ith(self._ctx, row), self._hidden))
        except BaseException:
            for feed in feeds:
                llama.llama_memory_seq_rm(self._memory, feed.kv.seq_id, feed.kv.length, -1)
            raise
        # 3. Every feed's tokens are cached now.
        for feed in feeds:
            feed.kv.length += len(feed.tokens)
        return [Scores(torch.from_numpy(np.stack(logits[f])) if feed.scored else None,
                       torch.from_numpy(np.stack(hidden[f])) if feed.features else None)
                for f, feed in enumerate(feeds)]

    def _decode(self, feeds: Sequence[Feed], chunk: list[tuple[int, int]]) -> None:
        """One llama_decode of `chunk`'s tokens; RuntimeError naming the cause if it fails."""
        batch = self._batch
        for row, (f, i) in enumerate(chunk):
            feed = feeds[f]
            batch.token[row] = feed.tokens[i]
            batch.pos[row] = feed.kv.length + i
            batch.n_seq_id[row] = 1
            batch.seq_id[row][0] = feed.kv.seq_id
            batch.logits[row] = feed.scored or feed.features
        batch.n_tokens = len(chunk)
        status = llama.llama_decode(self._ctx, batch)
        if status != 0:
            cause = "no free KV cells" if status == 1 else f"status {status}"
            raise RuntimeError(f"llama_decode failed: {cause}")

    def _set_embeddings(self, on: bool) -> None:
        if on != self._embeddings:
            llama.llama_set_embeddings(self._ctx, on)
            self._embeddings = on


def _row(pointer, size: int) -> np.ndarray:
    """A copy of `size` floats llama.cpp owns (its buffers are reused by the next decode)."""
    if not pointer:
        raise RuntimeError("llama.cpp returned no output for a row that asked for one")
    return np.ctypeslib.as_array(pointer, shape=(size,)).copy()
