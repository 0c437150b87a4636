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
session opened 10 cells later scores differently: blocks of 64 or more query rows take a tiled kernel
whose rounding depends on where cells sit); in its own stream its cells always start at 0.
Then a block scored at once, alone or batched, gives the logits of the same tokens decoded one by
one, bit for bit, whatever else the replica serves (tests/test_llamacpp_engine.py). The price is a
fixed share per session: `kv_tokens / max_sequences` tokens (`Capabilities.max_sequence_tokens`).

Draft trees. llama.cpp takes no attention mask: a token sees the cells holding its first sequence id
at positions up to its own, so a tree needs an id per leaf, each node carrying the ids of the leaves
below it and the context all of them; but a session's stream holds one id. What else was measured (one
thread of an AMD EPYC, embedded Q4_1 target, 128 cached tokens; a chain pass of 3 tokens takes 29.6 ms,
of 9 73 ms): a stream per branch needs the context copied into each (llama.cpp copies whole streams,
7.7 ms per branch of 1,024 cells; 7 branches for 8 top-4 nodes) and recomputes shared nodes: slowest.
One cache for all sessions (`kv_unified`) scores trees exactly but no longer chains (a block after
another session opened: logits 0.57 apart; see streams above). Depth first in the session's stream, a
decode per leaf, is exact but a decode costs ~4.5 ms beyond its tokens: +23 % at 4 nodes, +59 % at 32.

Chosen: a second context, `kv_unified` on, for trees only, of TREE_STREAMS streams' cells (a tree and
its session's context fit one stream's share; the core defers trees beyond that many a pass), made
with the engine (made at the first tree, 1.5 GB cleared at 65,536 cells, it stalled that pass for
seconds). A pass copies each tree's session cells there (llama.cpp's sequence state), gives them every
leaf's id (`llama_memory_seq_cp` within a stream moves no data) and decodes the trees at once;
keep_rows copies context and kept path back over the session's stream, consecutive. It costs a chain
of as many tokens plus the copies: ~1 ms in and 0.8 ms back at 128 cached tokens (tree/chain
1.00-1.03), ~7 and ~5 ms at 1,000 (bench/tree_verify_cost.py). Exact, bit for bit
(tests/test_llamacpp_trees.py): the copies keep a session's cells in order, so flash attention visits
a node's context and ancestors as a chain's, given under 64 rows per ubatch (from 64 its tiled kernel
rounds otherwise, logits 1.1 apart). A chain-shaped tree is scored as a chain. Limits: a pass's trees
are kept or cut before the next with trees; 256 leaves and TREE_STREAMS trees a pass.

ctypes releases the GIL during every llama.cpp call, so the replica's gRPC threads run during a pass.
"""
from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as llama
import numpy as np
import torch

from ...common.protocol.errors import ResourceExhausted
from ...common.protocol.tree import feed_depths
from .base import Capabilities, Feed, Scores

FTYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 15: "Q4_K_M", 17: "Q5_K_M",
          18: "Q6_K", 32: "BF16"}  # llama_ftype values of the weight types a user is likely to bring
MAX_BATCH_TOKENS = 2048  # tokens per llama_decode call; a larger pass is split (the logits are read in between)
TREE_BRANCHES = 256  # llama.cpp's LLAMA_MAX_SEQ: the tree context's sequence ids, one per leaf of a pass's trees
TREE_STREAMS = 8  # the tree context holds this many streams' cells: trees a pass (module doc)
TREE_UBATCH = 63  # tree rows per ubatch: below the 64 query rows where flash attention goes tiled (module doc)
STATE_HEADER = struct.Struct("<IiI")  # a sequence state's magic, sequence id and stream count


def _quiet(level: int, text: bytes, data: ctypes.c_void_p) -> None:
    """llama.cpp's log callback: its progress chatter would drown the server's own log lines."""


_LOG_CALLBACK = llama.llama_log_callback(_quiet)  # kept alive for the process: llama.cpp holds the pointer


@dataclass(frozen=True)
class _Tree:
    """A tree scored in the tree context and not yet kept or cut."""

    start: int  # the session's length before the pass
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    sequences: tuple[tuple[int, ...], ...]  # per fed token, the ids of the leaves below it (the first rules)


@dataclass(eq=False)
class LlamaSequence:
    """One session's cache: a llama.cpp sequence id (taken at the first reservation) and its length."""

    length: int = 0  # tokens cached (after a tree pass, with the tree's tokens until keep_rows)
    held: int = 0  # cells reserved for it, >= length
    seq_id: int | None = None
    tree: _Tree | None = None  # the last pass's tree, until keep_rows, truncate or release


class _Context:
    """A llama_context over the engine's model, and the batch its decodes fill."""

    def __init__(self, model, source: str, cells: int, sequences: int, unified: bool, ubatch: int, threads: int,
                 flash_attention: bool) -> None:
        params = llama.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = cells, min(cells, MAX_BATCH_TOKENS), min(cells, ubatch)
        params.n_seq_max, params.kv_unified = sequences, unified
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = (llama.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attention
                                  else llama.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.pooling_type = llama.LLAMA_POOLING_TYPE_NONE  # features: one hidden state per position
        params.embeddings = False  # switched on only for passes that carry a features feed
        self.ctx = llama.llama_init_from_model(model, params)
        if not self.ctx:
            raise ValueError(f"llama.cpp cannot make a context of {cells} tokens for {source}")
        self.memory = llama.llama_get_memory(self.ctx)
        self.streams, self.batch_size, self.embeddings = 1 if unified else sequences, params.n_batch, False
        self.batch = llama.llama_batch_init(self.batch_size, 0, sequences if unified else 1)

    def set_embeddings(self, on: bool) -> None:
        """Final hidden states from the next decodes, or not."""
        if on != self.embeddings:
            llama.llama_set_embeddings(self.ctx, on)
            self.embeddings = on

    def decode(self, rows: Sequence[tuple[int, int, Sequence[int], bool]]) -> None:
        """One llama_decode of `rows` (token, position, sequence ids: the first rules what it sees, whether
        it is an output); RuntimeError naming the cause if it fails."""
        batch = self.batch
        for r, (token, position, seq_ids, output) in enumerate(rows):
            batch.token[r], batch.pos[r], batch.n_seq_id[r], batch.logits[r] = token, position, len(seq_ids), output
            for k, seq_id in enumerate(seq_ids):
                batch.seq_id[r][k] = seq_id
        batch.n_tokens = len(rows)
        status = llama.llama_decode(self.ctx, batch)
        if status != 0:
            cause = "no free KV cells" if status == 1 else f"status {status}"
            raise RuntimeError(f"llama_decode failed: {cause}")


class LlamaCppEngine:
    """A GGUF model in one llama.cpp context, and a second for draft trees (implements
    engine.base.Engine; its handles are LlamaSequences)."""

    def __init__(self, gguf: str | Path, kv_tokens: int, max_sequences: int, threads: int = 1,
                 flash_attention: bool = True, trees: bool = True) -> None:
        """`flash_attention` off only to measure what it buys (bench/llamacpp_engine.py): without it
        blocks are not scored exactly as single tokens (docs/engine.md). `trees` off: chains only."""
        llama.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())
        llama.llama_backend_init()
        self._model = llama.llama_model_load_from_file(str(gguf).encode(), llama.llama_model_default_params())
        if not self._model:
            raise ValueError(f"llama.cpp cannot load {gguf}")
        self._source = str(gguf)  # kv_unified off below: a stream per session (module doc)
        self._main = _Context(self._model, self._source, kv_tokens, max_sequences, False, MAX_BATCH_TOKENS, threads,
                              flash_attention)
        self._pending = 0  # trees scored and not yet kept or cut
        self._state = bytearray()  # a sequence state on its way between the two contexts
        self._vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self._model))
        self._hidden, self._capacity = llama.llama_model_n_embd(self._model), kv_tokens
        self._per_sequence = llama.llama_n_ctx_seq(self._main.ctx)
        streams = min(TREE_STREAMS, max_sequences)
        self._trees = _Context(self._model, self._source, streams * self._per_sequence, TREE_BRANCHES, True,
                               TREE_UBATCH, threads, flash_attention) if trees else None
        self._free_ids = list(range(max_sequences - 1, -1, -1))
        self._held = 0
        ftype = llama.llama_model_ftype(self._model)
        self.capabilities = Capabilities(name="llamacpp", device="cpu", dtype=FTYPES.get(ftype, f"ftype {ftype}"),
                                         feature_dim=self._hidden, tree_masks=trees, max_tree_leaves=TREE_BRANCHES,
                                         max_trees=streams, max_sequence_tokens=self._per_sequence)

    def __del__(self) -> None:
        for context in (getattr(self, "_trees", None), getattr(self, "_main", None)):  # before the model
            if context is not None:
                llama.llama_batch_free(context.batch)
                llama.llama_free(context.ctx)
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
        """Keep the first `length` tokens; the cells after them are free again. After a tree pass, the
        tree's tokens kept must be a chain from its first (see keep_rows); keeping none drops the tree."""
        if kv.tree is not None:
            start = kv.tree.start
            if length > start:
                self.keep_rows(kv, start, range(min(length, kv.length) - start))
                return
            self._drop_tree(kv)
            kv.length = start
        if kv.seq_id is not None and length < kv.length:
            llama.llama_memory_seq_rm(self._main.memory, kv.seq_id, length, -1)
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
        llama.llama_memory_seq_rm(self._trees.memory, branch, start + len(rows), -1)
        self._drop_tree(kv)
        self._move(self._trees, branch, self._main, kv.seq_id)
        kv.length = start + len(rows)
        self.truncate(kv, kv.length)  # the cells held beyond go back

    def release(self, kv: LlamaSequence) -> None:
        """Every cell and the sequence id back."""
        if kv.tree is not None:
            self._drop_tree(kv)
        if kv.seq_id is not None:
            llama.llama_memory_seq_rm(self._main.memory, kv.seq_id, -1, -1)
            self._free_ids.append(kv.seq_id)
        self._held -= kv.held
        kv.length = kv.held = 0
        kv.seq_id = None

    def forward(self, feeds: Sequence[Feed]) -> list[Scores]:
        """Append every feed's tokens to its sequence in one pass: the chains in one llama_decode of
        the sessions' context, the trees in one of the tree context (more only past MAX_BATCH_TOKENS);
        per feed, its Scores. On failure every sequence is as it was before the pass."""
        trees = [f for f, feed in enumerate(feeds) if _is_tree(feed)]
        self._check(feeds, trees)
        chains = [f for f in range(len(feeds)) if f not in trees]
        logits: list[list[np.ndarray]] = [[] for _ in feeds]
        hidden: list[list[np.ndarray]] = [[] for _ in feeds]
        planted: dict[int, _Tree] = {}
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
                llama.llama_memory_seq_rm(self._main.memory, feed.kv.seq_id, feed.kv.length, -1)
            raise
        # 3. Every feed's tokens are cached now (a tree's in the tree context, until keep_rows).
        self._pending += len(planted)
        for f, feed in enumerate(feeds):
            feed.kv.tree = planted.get(f)
            feed.kv.length += len(feed.tokens)
        return [Scores(torch.from_numpy(np.stack(logits[f])) if feed.scored else None,
                       torch.from_numpy(np.stack(hidden[f])) if feed.features else None)
                for f, feed in enumerate(feeds)]

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

    def _score_trees(self, feeds: Sequence[Feed], trees: list[int], planted: dict[int, _Tree],
                     logits: list[list[np.ndarray]], hidden: list[list[np.ndarray]]) -> None:
        """Copy each tree's session cells into the tree context under every leaf's sequence id and
        decode the trees, whole trees per decode (llama.cpp checks each sequence's positions per call)."""
        context = self._trees
        llama.llama_memory_clear(context.memory, False)  # nothing is pending (checked): cells fill in order
        context.set_embeddings(any(feeds[f].features for f in trees))
        free = iter(range(TREE_BRANCHES))
        for f in trees:
            tree = planted[f] = _plant(feeds[f], free)
            first = tree.sequences[0]  # the root's: every leaf's id
            self._move(self._main, feeds[f].kv.seq_id, context, first[0])
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

    def _read(self, context: _Context, feeds: Sequence[Feed], chunk: list[tuple[int, int]],
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

    def _move(self, src: _Context, src_seq: int, dst: _Context, dst_seq: int) -> None:
        """Replace `dst_seq`'s cells in `dst` by a copy of `src_seq`'s in `src`, in order, through
        llama.cpp's sequence state: a header (magic, sequence id, stream count), then per stream a cell
        count and its cells, only the sequence's own stream having any. The contexts count streams
        differently, so the header and the empty streams' counts are rewritten in place around that
        stream's block, which Python never copies. RuntimeError if the state is not laid out so."""
        size = llama.llama_state_seq_get_size(src.ctx, src_seq)
        src_stream, dst_stream = (0 if c.streams == 1 else seq for c, seq in ((src, src_seq), (dst, dst_seq)))
        before, after = 4 * src_stream, 4 * (src.streams - 1 - src_stream)
        pad, tail = 4 * dst_stream, 4 * (dst.streams - 1 - dst_stream)
        if len(self._state) < size + 4 * (src.streams + dst.streams):
            self._state = bytearray(size + 4 * (src.streams + dst.streams))
        state = self._state  # read in at `pad`, the block lies where the rewritten state needs it
        n = llama.llama_state_seq_get_data(src.ctx, (ctypes.c_uint8 * size).from_buffer(state, pad), size, src_seq)
        magic, seq_id, streams = STATE_HEADER.unpack_from(state, pad)
        block, end = pad + STATE_HEADER.size + before, pad + n - after
        if n == 0 or streams != src.streams or any(state[pad + STATE_HEADER.size:block]) or any(state[end:pad + n]):
            raise RuntimeError("llama.cpp's sequence state is not laid out as this engine expects")
        STATE_HEADER.pack_into(state, before, magic, seq_id, dst.streams)
        state[before + STATE_HEADER.size:block] = bytes(pad)
        state[end:end + tail] = bytes(tail)
        total = end + tail - before
        if not llama.llama_state_seq_set_data(dst.ctx, (ctypes.c_uint8 * total).from_buffer(state, before), total,
                                              dst_seq):
            raise RuntimeError("llama.cpp could not restore a sequence state")


def _is_tree(feed: Feed) -> bool:
    """True for a feed with parents that are not a chain (a chain-shaped tree is scored as a chain)."""
    return feed.parents is not None and any(p != j - 1 for j, p in enumerate(feed.parents))


def _plant(feed: Feed, free: Iterator[int]) -> _Tree:
    """The tree of `feed`, a sequence id per leaf from `free`: each token carries the ids of the leaves
    below it, so under its own first id it sees the cached context (which carries them all), its
    ancestors and itself, and no other token of the tree."""
    parents = tuple(feed.parents)
    sequences: list[list[int]] = [[] for _ in parents]
    for leaf in sorted(set(range(len(parents))) - set(parents)):
        seq_id, node = next(free), leaf
        while node >= 0:
            sequences[node].append(seq_id)
            node = parents[node]
    return _Tree(feed.kv.length, parents, tuple(feed_depths(parents)), tuple(map(tuple, sequences)))


def _row(pointer, size: int) -> np.ndarray:
    """A copy of `size` floats llama.cpp owns (its buffers are reused by the next decode)."""
    if not pointer:
        raise RuntimeError("llama.cpp returned no output for a row that asked for one")
    return np.ctypeslib.as_array(pointer, shape=(size,)).copy()
