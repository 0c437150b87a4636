"""A compact drafter's converted GGUF (common/models/drafter_gguf.py) run by llama.cpp: a `DraftLM`.

The GGUF's vocabulary is the drafter's head (its `head_ids` rows of the target's vocabulary), so the
model is fed input embeddings, not ids: for each token the row of the target's embedding matrix,
gathered in numpy from the fp16 file saved beside the GGUF. Logits come back over the head's rows and
are spread over the target's vocabulary as the torch drafter's are; the edge samples from them in
Python exactly as it does for torch, so the q it sends is exactly what it sampled from.

Built on llama-cpp-python's low-level API, like the cloud's engine (cloud/engine/llamacpp_engine.py).
The model is loaded once per process and file; each `LlamaCppLM` (one per generation's drafter) has
its own context: one sequence whose cached prefix is cut with `llama_memory_seq_rm`. Flash attention
is on, as in the engine: with it a block of rows is computed like the same rows one at a time, so a
reused prefix gives the logits a fresh context would. This module is the only one of the edge that
imports llama_cpp, and only `make_drafter` imports it, when a drafter runs on llama.cpp.
"""
from __future__ import annotations

import ctypes
import threading

import llama_cpp as llama
import numpy as np
import torch

from ..common.models.drafter_gguf import LlamaDraftFiles
from .draft_lm import reusable_prefix, to_vocab

MAX_BATCH = 512  # rows per llama_decode: a longer prompt is fed in chunks


def _quiet(level: int, text: bytes, data: ctypes.c_void_p) -> None:
    """llama.cpp's log callback: its loading chatter would interleave with the edge's output."""


_LOG_CALLBACK = llama.llama_log_callback(_quiet)  # kept alive for the process: llama.cpp holds the pointer
_LOCK = threading.Lock()
_MODELS: dict[tuple, LlamaDraftModel] = {}


class LlamaDraftModel:
    """A converted drafter loaded once: the llama.cpp model, the input embeddings (memory-mapped) and
    the vocabulary ids of the head's rows."""

    def __init__(self, files: LlamaDraftFiles, head_ids: np.ndarray) -> None:
        llama.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())
        llama.llama_backend_init()
        self.files = files
        self.model = llama.llama_model_load_from_file(str(files.gguf).encode(), llama.llama_model_default_params())
        if not self.model:
            raise ValueError(f"llama.cpp cannot load {files.gguf}")
        self.hidden = llama.llama_model_n_embd(self.model)
        self.n_ctx_train = llama.llama_model_n_ctx_train(self.model)
        rows = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self.model))
        self.embeddings = np.load(files.embeddings, mmap_mode="r")
        if rows != len(head_ids) or self.embeddings.shape[1] != self.hidden:
            raise ValueError(f"{files.gguf} does not fit its drafter ({rows} head rows for {len(head_ids)} "
                             f"head ids, embeddings {self.embeddings.shape}): convert it again")
        self.head_ids = torch.as_tensor(np.asarray(head_ids, dtype=np.int64))

    def __del__(self) -> None:
        if getattr(self, "model", None):
            llama.llama_model_free(self.model)

    @classmethod
    def shared(cls, files: LlamaDraftFiles, head_ids: np.ndarray) -> LlamaDraftModel:
        """The process's one copy of these files' model (a drafter is built per generation)."""
        key = (str(files.gguf), files.gguf.stat().st_mtime_ns, str(files.embeddings))
        with _LOCK:
            if key not in _MODELS:
                _MODELS[key] = cls(files, head_ids)
            return _MODELS[key]


class LlamaCppLM:
    """One generation's drafter LM on llama.cpp (a DraftLM): a context holding one sequence."""

    def __init__(self, model: LlamaDraftModel, vocab_size: int, threads: int = 1, n_ctx: int = 0) -> None:
        """n_ctx: tokens the context holds; 0 = what the drafter was trained for (its target's)."""
        self.model = model
        self.vocab_size = vocab_size
        params = llama.llama_context_default_params()
        params.n_ctx = n_ctx or model.n_ctx_train
        params.n_batch = params.n_ubatch = min(params.n_ctx, MAX_BATCH)
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_ENABLED  # see the module's docstring
        params.embeddings = False  # logits, not hidden states
        self._ctx = llama.llama_init_from_model(model.model, params)
        if not self._ctx:
            raise ValueError(f"llama.cpp cannot make a context of {params.n_ctx} tokens for {model.files.gguf}")
        self.n_ctx = llama.llama_n_ctx(self._ctx)
        self._memory = llama.llama_get_memory(self._ctx)
        self._batch_size = params.n_batch
        # A batch of embeddings (embd = hidden): llama.cpp reads batch.embd instead of batch.token.
        self._batch = llama.llama_batch_init(self._batch_size, model.hidden, 1)
        self._rows = model.head_ids.numel()
        self.cached: list[int] = []  # the tokens whose KV is in the context

    @classmethod
    def open(cls, files: LlamaDraftFiles, head_ids, vocab_size: int) -> LlamaCppLM:
        """A fresh context over the process's copy of `files`; `head_ids`: the drafter's (tensor or array)."""
        ids = head_ids.cpu().numpy() if isinstance(head_ids, torch.Tensor) else np.asarray(head_ids)
        return cls(LlamaDraftModel.shared(files, ids), vocab_size, files.threads)

    def __del__(self) -> None:
        if getattr(self, "_batch", None) is not None:
            llama.llama_batch_free(self._batch)
        if getattr(self, "_ctx", None):
            llama.llama_free(self._ctx)

    def advance(self, context: list[int]) -> torch.Tensor:
        """See DraftLM.advance."""
        keep = reusable_prefix(self.cached, context)
        if keep < len(self.cached):
            llama.llama_memory_seq_rm(self._memory, 0, keep, -1)
            del self.cached[keep:]
        return self.feed(context[keep:])

    def feed(self, ids: list[int]) -> torch.Tensor:
        """See DraftLM.feed. ValueError past the context's size (the cache is left as it was)."""
        if not ids:
            raise ValueError("feed at least one token")
        if len(self.cached) + len(ids) > self.n_ctx:
            raise ValueError(f"the llama.cpp drafter holds {self.n_ctx} tokens; the context grew to "
                             f"{len(self.cached) + len(ids)}")
        start = len(self.cached)
        try:
            for offset in range(0, len(ids), self._batch_size):
                self._decode(ids[offset:offset + self._batch_size], start + offset, last=offset + self._batch_size >= len(ids))
        except BaseException:
            llama.llama_memory_seq_rm(self._memory, 0, start, -1)
            raise
        self.cached.extend(ids)
        pointer = llama.llama_get_logits_ith(self._ctx, -1)
        if not pointer:
            raise RuntimeError("llama.cpp returned no logits")
        # A copy: llama.cpp reuses the buffer on the next decode.
        head = torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(self._rows,)).copy())
        return to_vocab(head, self.model.head_ids, self.vocab_size)

    def _decode(self, chunk: list[int], pos: int, last: bool) -> None:
        """One llama_decode of `chunk`'s embeddings at positions pos..; logits only for the final row
        of the final chunk (the only one drafting reads)."""
        batch, n, hidden = self._batch, len(chunk), self.model.hidden
        rows = np.ascontiguousarray(self.model.embeddings[chunk], dtype=np.float32)
        ctypes.memmove(batch.embd, rows.ctypes.data, n * hidden * 4)
        for i in range(n):
            batch.pos[i] = pos + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = last and i == n - 1
        batch.n_tokens = n
        status = llama.llama_decode(self._ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed: status {status}")
