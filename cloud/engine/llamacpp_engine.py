"""The llama.cpp engine: a GGUF target served by llama.cpp's CPU kernels through llama-cpp-python's
low-level API (the high-level `Llama` class holds one sequence and an n_ctx × vocab score matrix).

One `llama_context` per engine holds the sessions' keys and values in `streams` streams of
`stream_tokens` cells each (llama.cpp's per-sequence KV, `kv_unified` off; the serving default is 8
streams of max_context cells). A session resident in a stream is a llama.cpp sequence id. A pass is one
`llama_decode` carrying every feed (rounds, decode steps, prefill chunks), with an output row only where
a rule needs logits or a session asked for features. A rejected suffix is cut with `llama_memory_seq_rm`.

Exactness (docs/engine.md). Flash attention is on: with it llama.cpp's CPU kernels compute each row of a
block exactly as they compute that token alone, given under 64 rows per ubatch (llamacpp_context.py
UBATCH), so a cache holds the same bits however its tokens were fed. And each session has its own
stream: the flash-attention kernel walks the cache in tiles of 64 cells, so in a cache shared by all
sessions a session's logits would depend on where its cells fall among other sessions' (a session opened
10 cells later scores differently); in its own stream its cells always start at 0. Then a block scored
at once, alone or batched, gives the logits of the same tokens decoded one by one, bit for bit,
whatever else the replica serves (tests/test_llamacpp_engine.py).

More sessions than streams. llama.cpp's streams are all one size and cannot grow: their K/V are one
tensor per layer of [cells × streams], zero-filled and resident from the start (64 streams of 4,096 cells
would take 5.6 GiB for the embedded target). So a replica keeps few, full-length streams, and a session
that needs one while none is free takes the stream of the least recently used session that is not in
the pass being planned: that session's state is parked in host memory (`llama_state_seq_get_data`,
23 KB per cached token for the embedded target) and restored, into whatever stream is free, when it next
runs (`set_data`; its cells land contiguous from 0, so it scores bit for bit as before). Host memory for
parked states is bounded (`parked_tokens`); past it `fits` says no and the core evicts idle sessions.
`copy_prefix` copies a session's first tokens into a new session's stream the same way.

Draft trees. llama.cpp takes no attention mask: a token sees the cells holding its first sequence id
at positions up to its own, so a tree needs an id per leaf, each node carrying the ids of the leaves
below it and the context all of them; but a session's stream holds one id. So a second context,
`kv_unified` on, of TREE_CELLS cells, scores trees only (the alternatives measured, all slower or
inexact, are in docs/engine.md); it is made with the engine (made at the first tree, it stalled that
pass for seconds). A pass copies each tree's session cells there (llama.cpp's sequence state), gives
them every leaf's id (`llama_memory_seq_cp` within a stream moves no data) and decodes the trees at
once; keep_rows copies context and kept path back over the session's stream, consecutive. It costs a
chain of as many tokens plus the copies (bench/engine.py tree), and is exact, bit for bit
(tests/test_llamacpp_trees.py): the copies keep a session's cells in order. A chain-shaped tree is
scored as a chain. Limits: a pass's trees are kept or cut before the next with trees; 256 leaves and
`max_trees` trees (as many sessions' full contexts as TREE_CELLS holds, at most 8) a pass.

ctypes releases the GIL during every llama.cpp call, so the replica's gRPC threads run during a pass.
"""
from __future__ import annotations

import mmap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as llama
import numpy as np
import torch

from ...common.protocol.errors import ResourceExhausted
from .base import Capabilities, Feed, KVLimits, KVSequence, Scores
from .llamacpp_context import LOG_CALLBACK, MAX_BATCH_TOKENS, UBATCH, Context, Mover
from .llamacpp_trees import PlantedTree, is_tree, plant

FTYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 15: "Q4_K_M", 17: "Q5_K_M",
          18: "Q6_K", 32: "BF16"}  # llama_ftype values of the weight types a user is likely to bring
TREE_BRANCHES = 256  # llama.cpp's LLAMA_MAX_SEQ: the tree context's sequence ids, one per leaf of a pass's trees
TREE_STREAMS = 8  # trees a pass at most
TREE_CELLS = 8192  # the tree context's cells: 8 trees of sessions up to 1,024 tokens, fewer of longer ones


@dataclass(eq=False)
class LlamaSequence:
    """One session's cache: resident in a stream (a llama.cpp sequence id), parked in host memory, or
    empty; and its length."""

    length: int = 0  # tokens cached (after a tree pass, with the tree's tokens until keep_rows)
    held: int = 0  # cells reserved for it in its stream, >= length while resident
    seq_id: int | None = None  # its stream while resident
    parked: bytearray | mmap.mmap | None = None  # its state while parked
    parked_cells: int = 0  # tokens that state holds (>= length: a cut while parked applies at the restore)
    used: int = 0  # the engine's pass count when it was last reserved: who is parked first, and who not now
    since: float = 0.0  # when it last took a stream (time.monotonic())
    tree: PlantedTree | None = None  # the last pass's tree, until keep_rows, truncate or release


class LlamaCppEngine:
    """A GGUF model in one llama.cpp context, and a second for draft trees (implements
    engine.base.Engine; its handles are LlamaSequences)."""

    def __init__(self, gguf: str | Path, kv_tokens: int, max_sequences: int, threads: int = 1,
                 flash_attention: bool = True, trees: bool = True, parked_tokens: int = 0) -> None:
        """`kv_tokens` cells in `max_sequences` streams: sessions resident at once, each up to
        kv_tokens / max_sequences tokens; `parked_tokens`: the host memory idle sessions' states may
        take, in tokens (0: a session without a stream is evicted instead). `flash_attention` off only to
        measure what it buys (92253c5:bench/llamacpp_engine.py): without it blocks are not scored exactly as
        single tokens (docs/engine.md). `trees` off: chains only."""
        llama.llama_log_set(LOG_CALLBACK, None)
        llama.llama_backend_init()
        self._model = llama.llama_model_load_from_file(str(gguf).encode(), llama.llama_model_default_params())
        if not self._model:
            raise ValueError(f"llama.cpp cannot load {gguf}")
        self._source = str(gguf)  # kv_unified off below: a stream per session (module doc)
        self._main = Context(self._model, self._source, kv_tokens, max_sequences, False, threads, flash_attention)
        self._mover = Mover()
        self._pending = 0  # trees scored and not yet kept or cut
        self._vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self._model))
        self._hidden, self._capacity = llama.llama_model_n_embd(self._model), kv_tokens
        self._per_sequence = llama.llama_n_ctx_seq(self._main.ctx)
        streams = max(1, min(TREE_STREAMS, max_sequences, TREE_CELLS // self._per_sequence))
        self._trees = Context(self._model, self._source, streams * self._per_sequence, TREE_BRANCHES, True,
                              threads, flash_attention) if trees else None
        self._free_ids = list(range(max_sequences - 1, -1, -1))
        self._resident: dict[int, LlamaSequence] = {}  # stream -> the sequence in it
        self._held = 0
        self._parked_budget, self._parked_cells = parked_tokens, 0
        self._passes = 1  # passes run (and failed); a sequence reserved since the last one is in the next
        self.parks = self.restores = 0  # states moved to host memory and back, since the start
        # What besides the model and the capabilities makes a pass cost what it does (a curve kept on
        # disk holds for these: cloud/core/cost_cache.py).
        self.pass_settings = {"library": f"llama-cpp-python {llama.__version__}", "threads": threads,
                              "flash_attention": flash_attention, "ubatch": UBATCH, "batch": self._main.batch_size,
                              "tree_cells": streams * self._per_sequence if trees else 0}
        self.park_rank: Callable[[KVSequence], float] = lambda kv: 0.0  # the core's policy (base.Parking)
        ftype = llama.llama_model_ftype(self._model)
        self.capabilities = Capabilities(name="llamacpp", device="cpu", dtype=FTYPES.get(ftype, f"ftype {ftype}"),
                                         feature_dim=self._hidden, tree_masks=trees, max_tree_leaves=TREE_BRANCHES,
                                         max_trees=streams, max_sequence_tokens=self._per_sequence,
                                         max_sequences_per_pass=max_sequences)

    @classmethod
    def serving(cls, gguf: str | Path, limits: KVLimits, threads: int) -> LlamaCppEngine:
        """The engine a replica serves with: `kv_streams` streams (at most `max_sessions`) of `max_context`
        cells, as many as `kv_cache_tokens` holds (at least one, of kv_cache_tokens cells if that is
        less than max_context), and the rest of kv_cache_tokens for parked states."""
        cells = min(limits.max_context, limits.kv_cache_tokens)
        streams = max(1, min(limits.kv_streams, limits.max_sessions, limits.kv_cache_tokens // cells))
        return cls(gguf, streams * cells, streams, threads, trees=limits.max_tree_nodes > 0,
                   parked_tokens=max(0, limits.kv_cache_tokens - streams * cells))

    def __del__(self) -> None:
        for context in (getattr(self, "_trees", None), getattr(self, "_main", None)):  # before the model
            if context is not None:
                context.free()
        if getattr(self, "_model", None):
            llama.llama_model_free(self._model)

    @property
    def vocab_size(self) -> int:
        """Rows of the output head."""
        return self._vocab

    @property
    def capacity_tokens(self) -> int:
        """Cells of the streams."""
        return self._capacity

    @property
    def parked_tokens(self) -> int:
        """Tokens the states parked in host memory hold."""
        return self._parked_cells

    def fill(self) -> float:
        """The fraction of all cells reserved by sessions."""
        return self._held / self._capacity

    def new_sequence(self) -> LlamaSequence:
        """An empty handle; it takes a stream when it first grows."""
        return LlamaSequence()

    def resident_since(self, kv: LlamaSequence) -> float | None:
        """When `kv` took its stream (time.monotonic()); None while it has none (base.Parking)."""
        return kv.since if kv.seq_id is not None else None

    def fits(self, kv: LlamaSequence, extra: int) -> bool:
        """True if `extra` more tokens fit in `kv`'s stream, and `kv` has a stream or can have one: a
        free one, or that of an idle session whose state fits in host memory."""
        if kv.length + extra > self._per_sequence:
            return False
        return kv.seq_id is not None or bool(self._free_ids) or self._victim(kv) is not None

    def reserve(self, kv: LlamaSequence, extra: int) -> None:
        """Take the cells `extra` more tokens need, in a stream (parking an idle session's state, or
        restoring `kv`'s, if it must); ResourceExhausted, taking nothing, if they do not fit. `kv` is not
        parked before the next pass."""
        if not self.fits(kv, extra):
            raise ResourceExhausted(f"the KV cache has no room for {extra} more tokens")
        if kv.seq_id is None:
            self._take_stream(kv)
        kv.used = self._passes
        need = max(0, kv.length + extra - kv.held)
        kv.held += need
        self._held += need

    def copy_prefix(self, src: LlamaSequence, dst: LlamaSequence, length: int) -> None:
        """Make the empty `dst` hold `src`'s first `length` tokens (see Engine): its stream gets `src`'s
        state, from its stream or host memory, cut after `length` tokens."""
        if dst.length or dst.seq_id is not None or dst.parked is not None:
            raise ValueError("a prefix is copied into an empty sequence only")
        if not 0 < length <= src.length or src.tree is not None:
            raise ValueError(f"cannot copy {length} tokens of a sequence of {src.length}")
        self.reserve(dst, length)  # may park `src` itself: then its state is read back from host memory
        state = src.parked if src.parked is not None else self._main.save(src.seq_id)
        self._main.load(dst.seq_id, state, length)
        dst.length = length

    def truncate(self, kv: LlamaSequence, length: int) -> None:
        """Keep the first `length` tokens; the cells after them are free again. After a tree pass, the
        tree's tokens kept must be a chain from its first (see keep_rows); keeping none drops the tree."""
        if kv.parked is not None:
            kv.length = min(kv.length, length)  # the restore cuts it
            if not kv.length:
                self.release(kv)
            return
        if kv.tree is not None:
            start = kv.tree.start
            if length > start:
                self.keep_rows(kv, start, range(min(length, kv.length) - start))
                return
            self._drop_tree(kv)
            kv.length = start
        if kv.seq_id is not None and length < kv.length:
            self._main.remove(kv.seq_id, length)
        kv.length = min(kv.length, length)
        self._held -= kv.held - kv.length
        kv.held = kv.length

    def keep_rows(self, kv: LlamaSequence, start: int, rows: Sequence[int]) -> None:
        """After a tree pass, keep the fed tokens `rows` (a root path) as the tokens from `start`: the
        branch of the path's end, cut below it, is copied from the tree context over the session's
        stream, consecutively. ValueError, changing nothing, if `rows` is no root path of the tree."""
        rows, tree = list(rows), kv.tree
        if tree is None:
            if rows != list(range(len(rows))):
                raise ValueError(f"a chain keeps consecutive rows, not {rows}")
            self.truncate(kv, start + len(rows))
            return
        steps = zip(rows, rows[1:])
        if start != tree.start or rows[:1] != [0] or any(b <= a or tree.parents[b] != a for a, b in steps):
            raise ValueError(f"rows {rows} from {start} are not a root path of the tree fed at {tree.start}")
        branch = tree.sequences[rows[-1]][0]
        self._trees.remove(branch, start + len(rows))
        self._drop_tree(kv)
        self._mover.move(self._trees, branch, self._main, kv.seq_id)
        kv.length = start + len(rows)
        self.truncate(kv, kv.length)  # the cells held beyond go back

    def release(self, kv: LlamaSequence) -> None:
        """Every cell, the stream or the parked state back."""
        if kv.tree is not None:
            self._drop_tree(kv)
        if kv.seq_id is not None:
            self._main.remove(kv.seq_id)
            self._free_stream(kv)
        self._parked_cells -= kv.parked_cells
        kv.parked, kv.parked_cells = None, 0
        self._held -= kv.held
        kv.length = kv.held = 0

    def forward(self, feeds: Sequence[Feed]) -> list[Scores]:
        """Append every feed's tokens to its sequence in one pass: the chains in one llama_decode of
        the sessions' context, the trees in one of the tree context (more only past MAX_BATCH_TOKENS);
        per feed, its Scores. On failure every sequence is as it was before the pass."""
        try:
            return self._forward(feeds)
        finally:
            self._passes += 1  # the sequences of this pass may be parked again

    def _forward(self, feeds: Sequence[Feed]) -> list[Scores]:
        trees = [f for f, feed in enumerate(feeds) if is_tree(feed)]
        self._check(feeds, trees)
        chains = [f for f in range(len(feeds)) if f not in trees]
        logits: list[list[np.ndarray]] = [[] for _ in feeds]
        hidden: list[list[np.ndarray]] = [[] for _ in feeds]
        planted: dict[int, PlantedTree] = {}
        try:
            # 1. The chains, every token as (feed, index in feed), a batch per decode; each decode's
            #    outputs are read before the next.
            self._main.set_embeddings(any(feeds[f].features for f in chains))
            tokens = [(f, i) for f in chains for i in range(len(feeds[f].tokens))]
            for start in range(0, len(tokens), self._main.batch_size):
                chunk = tokens[start:start + self._main.batch_size]
                self._main.decode([(feeds[f].tokens[i], feeds[f].kv.length + i, (feeds[f].kv.seq_id,),
                                    feeds[f].scored or feeds[f].features) for f, i in chunk])
                self._read(self._main, feeds, chunk, logits, hidden)
            # 2. The trees, beside copies of their sessions' caches.
            if trees:
                self._score_trees(feeds, trees, planted, logits, hidden)
        except BaseException:
            for feed in feeds:
                self._main.remove(feed.kv.seq_id, feed.kv.length)
            raise
        # 3. Every feed's tokens are cached now (a tree's in the tree context, until keep_rows).
        self._pending += len(planted)
        for f, feed in enumerate(feeds):
            feed.kv.tree = planted.get(f)
            feed.kv.length += len(feed.tokens)
        return [Scores(torch.from_numpy(np.stack(logits[f])) if feed.scored else None,
                       torch.from_numpy(np.stack(hidden[f])) if feed.features else None)
                for f, feed in enumerate(feeds)]

    def _victim(self, incoming: LlamaSequence) -> LlamaSequence | None:
        """The resident sequence that may give `incoming` its stream, of least `park_rank`, then least
        recently used: not reserved for the coming pass, no tree pending, its state within what host
        memory has left once `incoming`'s own parked state (if any) is restored."""
        room = self._parked_budget - self._parked_cells + incoming.parked_cells
        idle = [kv for kv in self._resident.values()
                if kv.used != self._passes and kv.tree is None and kv.length <= room]
        return min(idle, key=lambda kv: (self.park_rank(kv), kv.used), default=None)

    def _take_stream(self, kv: LlamaSequence) -> None:
        """Give `kv` a stream (fits() said one can be had), restoring its parked state into it."""
        if not self._free_ids:
            self._park(self._victim(kv))
        kv.seq_id = self._free_ids.pop()
        kv.since = time.monotonic()
        self._resident[kv.seq_id] = kv
        if kv.parked is None:
            return
        try:
            self._main.load(kv.seq_id, kv.parked, kv.length)
        except BaseException:
            self._free_stream(kv)
            raise
        self._parked_cells -= kv.parked_cells
        kv.parked, kv.parked_cells = None, 0
        kv.held = kv.length
        self._held += kv.held
        self.restores += 1

    def _park(self, kv: LlamaSequence) -> None:
        """Move a resident sequence's state to host memory and free its stream."""
        if kv.length:
            kv.parked, kv.parked_cells = self._main.save(kv.seq_id), kv.length
            self._parked_cells += kv.length
            self.parks += 1
        self._main.remove(kv.seq_id)
        self._free_stream(kv)
        self._held -= kv.held
        kv.held = 0

    def _free_stream(self, kv: LlamaSequence) -> None:
        del self._resident[kv.seq_id]
        self._free_ids.append(kv.seq_id)
        kv.seq_id = None

    def _check(self, feeds: Sequence[Feed], trees: list[int]) -> None:
        """ValueError (ResourceExhausted: too many leaves) before anything changes if the pass cannot run."""
        for feed in feeds:
            if not feed.tokens:
                raise ValueError("every feed needs at least one token")
            if feed.kv.tree is not None:
                raise ValueError("keep_rows or truncate the session's draft tree before feeding it again")
            if feed.kv.seq_id is None or feed.kv.held < feed.kv.length + len(feed.tokens):
                raise ValueError("reserve room for a feed's tokens before the pass")
            if feed.parents is not None and (len(feed.parents) != len(feed.tokens) or feed.parents[0] != -1
                                             or any(not 0 <= p < j for j, p in enumerate(feed.parents) if j)):
                raise ValueError(f"parents {feed.parents} do not make a tree rooted at the first token")
        if trees and self._pending:
            raise ValueError("every draft tree of the last pass must be kept or cut before the next pass with trees")
        if any(len(feeds[f].tokens) > MAX_BATCH_TOKENS for f in trees):
            raise ValueError(f"a draft tree has more than {MAX_BATCH_TOKENS} tokens")
        if sum(len(feeds[f].parents) - len(set(feeds[f].parents[1:])) for f in trees) > TREE_BRANCHES:  # leaves
            raise ResourceExhausted(f"the pass's draft trees have more than {TREE_BRANCHES} leaves")
        if trees and (self._trees is None or len(trees) > self.capabilities.max_trees):
            raise ResourceExhausted(f"this engine scores at most {self.capabilities.max_trees} draft trees a pass")

    def _score_trees(self, feeds: Sequence[Feed], trees: list[int], planted: dict[int, PlantedTree],
                     logits: list[list[np.ndarray]], hidden: list[list[np.ndarray]]) -> None:
        """Copy each tree's session cells into the tree context under every leaf's sequence id and
        decode the trees, whole trees per decode (llama.cpp checks each sequence's positions per call)."""
        context = self._trees
        llama.llama_memory_clear(context.memory, False)  # nothing is pending (checked): cells fill in order
        context.set_embeddings(any(feeds[f].features for f in trees))
        free = iter(range(TREE_BRANCHES))
        for f in trees:
            tree = planted[f] = plant(feeds[f], free)
            first = tree.sequences[0]  # the root's: every leaf's id
            self._mover.move(self._main, feeds[f].kv.seq_id, context, first[0])
            for seq_id in first[1:]:
                llama.llama_memory_seq_cp(context.memory, first[0], seq_id, -1, -1)
        chunks: list[list[tuple[int, int]]] = [[]]
        for f in trees:
            if chunks[-1] and len(chunks[-1]) + len(feeds[f].tokens) > context.batch_size:
                chunks.append([])
            chunks[-1] += [(f, i) for i in range(len(feeds[f].tokens))]
        for chunk in chunks:
            context.decode([(feeds[f].tokens[i], planted[f].start + planted[f].depths[i], planted[f].sequences[i],
                             feeds[f].scored or feeds[f].features) for f, i in chunk])
            self._read(context, feeds, chunk, logits, hidden)

    def _read(self, context: Context, feeds: Sequence[Feed], chunk: list[tuple[int, int]],
              logits: list[list[np.ndarray]], hidden: list[list[np.ndarray]]) -> None:
        """The outputs of the decode of `chunk`, row by row, into their feeds' lists."""
        for row, (f, _) in enumerate(chunk):
            if feeds[f].scored:
                logits[f].append(_row(llama.llama_get_logits_ith(context.ctx, row), self._vocab))
            if feeds[f].features:
                hidden[f].append(_row(llama.llama_get_embeddings_ith(context.ctx, row), self._hidden))

    def _drop_tree(self, kv: LlamaSequence) -> None:
        """Forget the session's pending tree (its cells go at the tree context's next clear)."""
        kv.tree, self._pending = None, self._pending - 1


def _row(pointer, size: int) -> np.ndarray:
    """A copy of `size` floats llama.cpp owns (its buffers are reused by the next decode)."""
    if not pointer:
        raise RuntimeError("llama.cpp returned no output for a row that asked for one")
    return np.ctypeslib.as_array(pointer, shape=(size,)).copy()
