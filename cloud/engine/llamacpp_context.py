"""A llama.cpp context and the sequence states the llama.cpp engine moves between streams, host memory
and contexts (cloud/engine/llamacpp_engine.py says why each exists).

A sequence's state (`llama_state_seq_get_data`) is a header (magic, sequence id, stream count), then
per stream a cell count and, for the stream holding the sequence, its cells in order: their positions,
then every layer's key rows and value rows. Restored into an empty stream (`set_data`) the cells land
contiguous from cell 0, as they were computed, which is what keeps a restored session exact.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import struct
from collections.abc import Sequence

import llama_cpp as llama

MAX_BATCH_TOKENS = 2048  # tokens per llama_decode call; a larger pass is split (the logits are read in between)
# Rows of one ubatch at most, in every context. From 64 query rows llama.cpp's flash attention takes a
# tiled kernel that rounds differently from its one-row kernel (logits up to 0.94 apart): a cache filled
# in chunks of 64 or more would then depend on how a prompt was chunked, which the scheduler varies
# with load. Under 64 rows every cell is computed as if its token were decoded alone, so a cache is a
# function of its tokens only: a prompt prefilled in any chunks, a reply decoded token by token and a
# prefix copied from another session hold the same bits. It costs about a third of prefill speed
# (docs/engine.md).
UBATCH = 63
STATE_HEADER = struct.Struct("<IiI")  # a sequence state's magic, sequence id and stream count
# States this large are parked in transparent huge pages where the kernel offers them: a fresh buffer
# of 4 KiB pages faults them in one by one, which took 97 ms of the 88 MB state of a 4,024-token
# session (about 20 ms in huge pages). Smaller ones would waste up to 2 MiB each.
HUGE_STATE_BYTES = 16 << 20
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _quiet(level: int, text: bytes, data: ctypes.c_void_p) -> None:
    """llama.cpp's log callback: its progress chatter would drown the server's own log lines."""


LOG_CALLBACK = llama.llama_log_callback(_quiet)  # kept alive for the process: llama.cpp holds the pointer


class Context:
    """A llama_context over the engine's model, and the batch its decodes fill."""

    def __init__(self, model, source: str, cells: int, sequences: int, unified: bool, threads: int,
                 flash_attention: bool) -> None:
        params = llama.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = cells, min(cells, MAX_BATCH_TOKENS), min(cells, UBATCH)
        params.n_seq_max, params.kv_unified = sequences, unified
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = (llama.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attention
                                  else llama.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.pooling_type = llama.LLAMA_POOLING_TYPE_NONE  # features: one hidden state per position
        params.embeddings = False  # switched on only for passes that carry a features feed
        self.ctx = llama.llama_init_from_model(model, params)
        if not self.ctx:
            raise ValueError(f"llama.cpp cannot make a context of {cells} tokens for {source}")
        _release_output_rows(model, self.ctx, sequences)
        self.memory = llama.llama_get_memory(self.ctx)
        self.streams, self.batch_size, self.embeddings = 1 if unified else sequences, params.n_batch, False
        self.batch = llama.llama_batch_init(self.batch_size, 0, sequences if unified else 1)

    def free(self) -> None:
        """Give the context back to llama.cpp (before its model)."""
        llama.llama_batch_free(self.batch)
        llama.llama_free(self.ctx)

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

    def remove(self, seq_id: int, start: int = -1) -> None:
        """Drop the sequence's cells from position `start` on (-1: all of them)."""
        llama.llama_memory_seq_rm(self.memory, seq_id, start, -1)

    def save(self, seq_id: int) -> bytearray | mmap.mmap:
        """A copy of the sequence's state in host memory (what parks a session)."""
        size = llama.llama_state_seq_get_size(self.ctx, seq_id)
        state = _host_memory(size)
        if llama.llama_state_seq_get_data(self.ctx, _view(state, 0, size), size, seq_id) != size:
            raise RuntimeError("llama.cpp could not save a sequence state")
        return state

    def load(self, seq_id: int, state: bytearray | mmap.mmap, keep: int) -> None:
        """Put `state` (from `save` in this context) into the empty stream of `seq_id`, and keep its first
        `keep` tokens; RuntimeError, the stream left empty, if llama.cpp refuses it."""
        if llama.llama_state_seq_set_data(self.ctx, _view(state, 0, len(state)), len(state), seq_id) != len(state):
            self.remove(seq_id)
            raise RuntimeError("llama.cpp could not restore a sequence state")
        self.remove(seq_id, keep)


class Mover:
    """Copies a sequence's cells between two contexts that count their streams differently (the draft
    trees' context and the sessions'), through one reused buffer."""

    def __init__(self) -> None:
        self._state = bytearray()

    def move(self, src: Context, src_seq: int, dst: Context, dst_seq: int) -> None:
        """Replace `dst_seq`'s cells in `dst` by a copy of `src_seq`'s in `src`, in order. Only the
        sequence's own stream has cells, so the header and the empty streams' counts are rewritten in
        place around that stream's block, which Python never copies. RuntimeError if the state is not
        laid out so."""
        size = llama.llama_state_seq_get_size(src.ctx, src_seq)
        src_stream, dst_stream = (0 if c.streams == 1 else seq for c, seq in ((src, src_seq), (dst, dst_seq)))
        before, after = 4 * src_stream, 4 * (src.streams - 1 - src_stream)
        pad, tail = 4 * dst_stream, 4 * (dst.streams - 1 - dst_stream)
        if len(self._state) < size + 4 * (src.streams + dst.streams):
            self._state = bytearray(size + 4 * (src.streams + dst.streams))
        state = self._state  # read in at `pad`, the block lies where the rewritten state needs it
        n = llama.llama_state_seq_get_data(src.ctx, _view(state, pad, size), size, src_seq)
        magic, seq_id, streams = STATE_HEADER.unpack_from(state, pad)
        block, end = pad + STATE_HEADER.size + before, pad + n - after
        if n == 0 or streams != src.streams or any(state[pad + STATE_HEADER.size:block]) or any(state[end:pad + n]):
            raise RuntimeError("llama.cpp's sequence state is not laid out as this engine expects")
        STATE_HEADER.pack_into(state, before, magic, seq_id, dst.streams)
        state[before + STATE_HEADER.size:block] = bytes(pad)
        state[end:end + tail] = bytes(tail)
        total = end + tail - before
        if not llama.llama_state_seq_set_data(dst.ctx, _view(state, before, total), total, dst_seq):
            raise RuntimeError("llama.cpp could not restore a sequence state")


def _release_output_rows(model, ctx, sequences: int) -> None:
    """Give the kernel back the pages of the output rows llama.cpp reserved and zeroed at construction.

    A context reserves a logits row of the whole vocabulary per sequence it may hold, and touches them:
    the tree context's 256 sequences made that 48 MiB of resident memory at start for a 49,152-token
    vocabulary (148 MiB for a 151,936-token one), rows only a pass with as many outputs writes. llama.cpp
    reads no row a decode has not written, so the pages can go: they read as zeros again, as they were,
    and come back one by one as passes write them (docs/models.md, where the cloud's memory goes)."""
    vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
    base = ctypes.cast(llama.llama_get_logits(ctx), ctypes.c_void_p).value
    if not base:
        return
    page = mmap.PAGESIZE
    start, end = -(-base // page) * page, (base + vocab * sequences * 4) // page * page
    if end > start:
        _LIBC.madvise(start, end - start, mmap.MADV_DONTNEED)  # mmap.madvise takes only its own maps


def _host_memory(size: int) -> bytearray | mmap.mmap:
    """`size` bytes of host memory for a state; a large one in huge pages if the kernel has them."""
    if size < HUGE_STATE_BYTES:
        return bytearray(size)
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no transparent huge pages here: 4 KiB pages
        memory.madvise(mmap.MADV_HUGEPAGE)
    return memory


def _view(buffer: bytearray | mmap.mmap, offset: int, size: int):
    """`size` bytes of `buffer` from `offset`, as the uint8 array llama.cpp's state calls take (no copy)."""
    return (ctypes.c_uint8 * size).from_buffer(buffer, offset)
