"""A drafter LM run by llama.cpp: a `DraftLM`. Either a compact drafter's converted GGUF
(common/models/drafter_gguf.py), or a GGUF model of its own (a user's drafter file).

A converted drafter's vocabulary is its head (its `head_ids` rows of the target's vocabulary), so the
model is fed input embeddings, not ids: for each token the row of the target's embedding matrix,
gathered in numpy from the fp16 file saved beside the GGUF. Logits come back over the head's rows and
are spread over the target's vocabulary as the torch drafter's are. A GGUF model of its own is fed its
token ids and scores its whole vocabulary (padded to the target's if shorter). The edge samples from
the logits in Python exactly as it does for torch, so the q it sends is exactly what it sampled from.

Built on llama-cpp-python's low-level API, like the cloud's engine (cloud/engine/llamacpp_engine.py).
The model is loaded once per process and file; each `LlamaCppLM` (one per generation's drafter) has
its own context: the committed context is sequence 0, whose cached prefix is cut with
`llama_memory_seq_rm`. Flash attention is on, as in the engine: with it a block of rows is computed
like the same rows one at a time, so a reused prefix gives the logits a fresh context would. This
module is the only one of the edge that imports llama_cpp, and only `make_drafter` imports it, when a
drafter runs on llama.cpp.

Draft trees: llama.cpp takes no attention mask; a token attends to the cells of its (first) sequence
id at positions up to its own. So every sequence holds the context and one root path of the tree, a
branch: a node continues its parent's sequence when the parent is that sequence's newest cell and no
sibling took it yet, and else opens a sequence of its own with `llama_memory_seq_cp` of the parent's
up to the parent's position. In a unified cache (kv_unified) that copy only tags the cells with one
more sequence id; nothing moves. Siblings share a position but never a sequence, so none sees another.
Tree nodes are fed a depth at a time (those whose parents are cached), and dropped with
`llama_memory_seq_keep` of sequence 0 and a cut of sequence 0 after the context.
"""
from __future__ import annotations

import ctypes
import threading

import llama_cpp as llama
import numpy as np
import torch

from ..common.models.drafter_gguf import LlamaDraftFiles
from ..common.protocol.tree import ROOT
from .draft_lm import TreeNodes, reusable_prefix, to_vocab

MAX_BATCH = 512  # rows per llama_decode: a longer prompt is fed in chunks
# Sequences a context holds: the committed context and a branch per tree leaf at most (a draft tree of
# up to 255 nodes); llama.cpp's own limit (LLAMA_MAX_SEQ) is 256. They cost nothing in a unified cache.
MAX_SEQUENCES = 256


def _quiet(level: int, text: bytes, data: ctypes.c_void_p) -> None:
    """llama.cpp's log callback: its loading chatter would interleave with the edge's output."""


_LOG_CALLBACK = llama.llama_log_callback(_quiet)  # kept alive for the process: llama.cpp holds the pointer
_LOCK = threading.Lock()
_MODELS: dict[tuple, LlamaDraftModel] = {}


class LlamaDraftModel:
    """A drafter loaded once: the llama.cpp model and, for a converted compact drafter, the input
    embeddings (memory-mapped) and the vocabulary ids of the head's rows (both None for a GGUF model
    of its own, which is fed ids)."""

    def __init__(self, files: LlamaDraftFiles, head_ids: np.ndarray | None) -> None:
        llama.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())
        llama.llama_backend_init()
        self.files = files
        self.model = llama.llama_model_load_from_file(str(files.gguf).encode(), llama.llama_model_default_params())
        if not self.model:
            raise ValueError(f"llama.cpp cannot load {files.gguf}")
        self.hidden = llama.llama_model_n_embd(self.model)
        self.n_ctx_train = llama.llama_model_n_ctx_train(self.model)
        self.rows = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self.model))
        self.embeddings = self.head_ids = None
        if files.embeddings is None:
            return
        self.embeddings = np.load(files.embeddings, mmap_mode="r")
        if self.rows != len(head_ids) or self.embeddings.shape[1] != self.hidden:
            raise ValueError(f"{files.gguf} does not fit its drafter ({self.rows} head rows for {len(head_ids)} "
                             f"head ids, embeddings {self.embeddings.shape}): convert it again")
        self.head_ids = torch.as_tensor(np.asarray(head_ids, dtype=np.int64))

    def __del__(self) -> None:
        if getattr(self, "model", None):
            llama.llama_model_free(self.model)

    @classmethod
    def shared(cls, files: LlamaDraftFiles, head_ids: np.ndarray | None) -> LlamaDraftModel:
        """The process's one copy of these files' model (a drafter is built per generation)."""
        key = (str(files.gguf), files.gguf.stat().st_mtime_ns, str(files.embeddings))
        with _LOCK:
            if key not in _MODELS:
                _MODELS[key] = cls(files, head_ids)
            return _MODELS[key]


class LlamaCppLM:
    """One generation's drafter LM on llama.cpp (a DraftLM): a context holding the committed context as
    sequence 0 and a draft tree's branches as sequences of their own (see the module's docstring)."""

    def __init__(self, model: LlamaDraftModel, vocab_size: int, threads: int = 1, n_ctx: int = 0) -> None:
        """n_ctx: tokens the context holds (the target's max_context: a session never grows beyond it,
        whatever the drafter was trained for); 0 = what the drafter was trained for."""
        self.model = model
        self.vocab_size = vocab_size
        params = llama.llama_context_default_params()
        params.n_ctx = n_ctx or model.n_ctx_train
        params.n_batch = params.n_ubatch = min(params.n_ctx, MAX_BATCH)
        # llama.cpp keeps an output row per sequence, and a batch must have room for them all.
        params.n_seq_max = min(MAX_SEQUENCES, params.n_batch)
        params.kv_unified = True  # one buffer for every sequence: a branch is a tag on shared cells
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_ENABLED  # see the module's docstring
        params.embeddings = False  # logits, not hidden states
        self._ctx = llama.llama_init_from_model(model.model, params)
        if not self._ctx:
            raise ValueError(f"llama.cpp cannot make a context of {params.n_ctx} tokens for {model.files.gguf}")
        self.n_ctx = llama.llama_n_ctx(self._ctx)
        self._memory = llama.llama_get_memory(self._ctx)
        self._batch_size = params.n_batch
        self._sequences = params.n_seq_max
        # A batch of embeddings (embd = hidden): llama.cpp reads batch.embd instead of batch.token.
        self._batch = llama.llama_batch_init(self._batch_size, 0 if model.embeddings is None else model.hidden, 1)
        self._rows = model.rows
        self.cached: list[int] = []  # the context's tokens whose KV is in sequence 0
        self.tree = TreeNodes()
        self._seq_of: list[int] = []  # each tree node's sequence
        self._tip: dict[int, int] = {0: ROOT}  # each sequence's newest node (ROOT: the context's last token)

    @classmethod
    def open(cls, files: LlamaDraftFiles, head_ids, vocab_size: int, n_ctx: int = 0) -> LlamaCppLM:
        """A fresh context of `n_ctx` tokens (0: the drafter's trained length) over the process's copy of
        `files`; `head_ids`: the drafter's (tensor or array; None for a GGUF model of its own)."""
        ids = head_ids.cpu().numpy() if isinstance(head_ids, torch.Tensor) else head_ids
        return cls(LlamaDraftModel.shared(files, ids), vocab_size, files.threads, n_ctx)

    def __del__(self) -> None:
        if getattr(self, "_batch", None) is not None:
            llama.llama_batch_free(self._batch)
        if getattr(self, "_ctx", None):
            llama.llama_free(self._ctx)

    def advance(self, context: list[int]) -> torch.Tensor:
        """See DraftLM.advance."""
        self._drop_tree()
        keep = reusable_prefix(self.cached, context)
        if keep < len(self.cached):
            llama.llama_memory_seq_rm(self._memory, 0, keep, -1)
            del self.cached[keep:]
        return self.feed(context[keep:])

    def feed(self, ids: list[int]) -> torch.Tensor:
        """See DraftLM.feed. ValueError past the context's size (the cache is left as it was)."""
        if not ids:
            raise ValueError("feed at least one token")
        self._drop_tree()
        self._check_room(len(ids))
        start = len(self.cached)
        try:
            for offset in range(0, len(ids), self._batch_size):
                chunk = ids[offset:offset + self._batch_size]
                self._decode(chunk, range(start + offset, start + offset + len(chunk)), [0] * len(chunk),
                             outputs=1 if offset + self._batch_size >= len(ids) else 0)
        except BaseException:
            llama.llama_memory_seq_rm(self._memory, 0, start, -1)
            raise
        self.cached.extend(ids)
        return self._logits([-1])[0]

    def feed_tree(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """See DraftLM.feed_tree. ValueError past the context's size (the cache is left as it was) or
        past the sequences a context holds (the tree is dropped)."""
        self._check_room(len(tokens))
        start = len(self.tree)
        depths = self.tree.add(tokens, parents)
        rows: dict[int, torch.Tensor] = {}
        try:
            pending = list(range(start, len(self.tree)))
            while pending:
                # A depth at a time: a node's sequence is opened from its parent's cell, so that must exist.
                ready = [i for i in pending if self.tree.parents[i] < start or self.tree.parents[i] in rows]
                for offset in range(0, len(ready), self._batch_size):
                    chunk = ready[offset:offset + self._batch_size]
                    seqs = [self._branch(i) for i in chunk]
                    self._decode([tokens[i - start] for i in chunk],
                                 [len(self.cached) + depths[i - start] - 1 for i in chunk], seqs, outputs=len(chunk))
                    rows.update(zip(chunk, self._logits(range(len(chunk)))))
                pending = [i for i in pending if i not in rows]
        except BaseException:
            self._drop_tree()
            raise
        return torch.stack([rows[i] for i in range(start, len(self.tree))])

    def _check_room(self, extra: int) -> None:
        """ValueError when `extra` more cells would not fit the context."""
        if len(self.cached) + len(self.tree) + extra > self.n_ctx:
            raise ValueError(f"the llama.cpp drafter holds {self.n_ctx} tokens; the context grew to "
                             f"{len(self.cached) + len(self.tree) + extra}")

    def _branch(self, node: int) -> int:
        """The sequence `node` goes into: its parent's when the parent is that sequence's newest cell,
        else a new one holding the context and the path to the parent (module docstring)."""
        parent = self.tree.parents[node]
        seq = 0 if parent == ROOT else self._seq_of[parent]
        if self._tip[seq] != parent:
            # The parent has a child already (a sibling of this node, cached or in this batch).
            if len(self._tip) == self._sequences:
                raise ValueError(f"this llama.cpp drafter holds draft trees of {self._sequences - 1} leaves at most")
            new = len(self._tip)
            end = len(self.cached) + (0 if parent == ROOT else self.tree.depths[parent])
            llama.llama_memory_seq_cp(self._memory, seq, new, 0, end)
            seq = new
        self._tip[seq] = node
        self._seq_of.append(seq)
        return seq

    def _drop_tree(self) -> None:
        """Remove every branch and the tree nodes of sequence 0: the cache holds the context again."""
        if len(self.tree):
            llama.llama_memory_seq_keep(self._memory, 0)
            llama.llama_memory_seq_rm(self._memory, 0, len(self.cached), -1)
            self.tree.clear()
            self._seq_of.clear()
        self._tip = {0: ROOT}

    def _logits(self, rows) -> torch.Tensor:
        """The last decode's logits at batch rows `rows` (-1: its last), [len(rows), V]."""
        out = []
        for row in rows:
            pointer = llama.llama_get_logits_ith(self._ctx, row)
            if not pointer:
                raise RuntimeError("llama.cpp returned no logits")
            # A copy: llama.cpp reuses the buffer on the next decode.
            out.append(torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(self._rows,)).copy()))
        return to_vocab(torch.stack(out), self.model.head_ids, self.vocab_size)

    def _decode(self, chunk: list[int], positions, seqs: list[int], outputs: int) -> None:
        """One llama_decode of `chunk` (its embeddings, or its ids for a model of its own) at `positions`,
        row i in sequence seqs[i]; logits for the last `outputs` rows (a chain reads only its final
        row's, a tree every node's)."""
        batch, n, hidden = self._batch, len(chunk), self.model.hidden
        if self.model.embeddings is None:
            for i, token in enumerate(chunk):
                batch.token[i] = token
        else:
            rows = np.ascontiguousarray(self.model.embeddings[chunk], dtype=np.float32)
            ctypes.memmove(batch.embd, rows.ctypes.data, n * hidden * 4)
        for i, (pos, seq) in enumerate(zip(positions, seqs)):
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = i >= n - outputs
        batch.n_tokens = n
        status = llama.llama_decode(self._ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed: status {status}")
