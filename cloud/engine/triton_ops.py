"""The forward pass's kernels for CUDA, in Triton: batch-invariant by construction, and capturable
in CUDA graphs.

A library matrix product picks its kernel (tile shape, split-K) from the number of rows, so a row's
bits depend on how many other rows share the pass (measured: cuBLAS on an H100 gives the 8B shape's
o and down products other bits at 1-64 rows than at 320; docs/engine.md). Here a weight's reduction
is fixed by the weight alone: its K range is cut into SPLIT equal parts, each walked in BLOCK_K steps
from its start, and the parts are added in order. A row's result then depends only on that row and
the weight. The tile's rows and columns may still follow the pass's size (few rows: narrow tiles,
for bandwidth; many: wide ones, for arithmetic) only where a start-up check (`check_tiles`) finds
both give every row the same bits. Attention walks each group's key positions in tiles of BLOCK_N
from position 0 (see torch_ops.py for why that keeps a query's sums fixed), reading keys through the
session's page table, and a draft tree node through its root path (cloud/engine/batch.py). Norms,
rotary and SiLU are one program per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .batch import GroupTensors

BLOCK_K = 64
ATTN_BLOCK_M = 64  # (query, head) rows per attention program
ATTN_BLOCK_N = 64  # key positions per attention step (torch_ops.KEY_CHUNK)
SMS_TO_FILL = 264  # programs a one-row-tile product should reach: two per multiprocessor of an H100
MIN_SPLIT_K = 512  # a split of K shorter than this is not worth a second pass over the partial sums
SMALL_ROWS = 64  # passes of at most this many rows use the narrow tiles


@dataclass(frozen=True)
class Tiles:
    """One launch shape of the product kernel."""

    rows: int
    cols: int
    warps: int
    stages: int


NARROW = Tiles(64, 64, 4, 4)  # decode-sized passes: bound by reading the weight
WIDE = Tiles(128, 128, 8, 3)  # verify and prefill passes: bound by arithmetic


def split_of(n: int, k: int) -> int:
    """Parts the reduction over K of an n×k weight is cut into: enough programs for a one-row-tile
    product to keep the memory system busy, none shorter than MIN_SPLIT_K. Fixed per weight."""
    split = 1
    while triton.cdiv(n, NARROW.cols) * split < SMS_TO_FILL and k // (2 * split) >= MIN_SPLIT_K:
        split *= 2
    return split


@triton.jit(do_not_specialize=["m"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, m, n, k, k_part, stride_x, stride_w, stride_y,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    part = tl.program_id(1)
    tiles_m, tiles_n = tl.cdiv(m, BM), tl.cdiv(n, BN)
    # Grouped order: consecutive programs share a weight column tile (it stays in L2).
    per_group = GROUP * tiles_n
    first_m = (pid // per_group) * GROUP
    size_m = tl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    end = tl.minimum(k, (part + 1) * k_part)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for start in range(part * k_part, end, BK):
        kk = start + ks
        a = tl.load(x_ptr + rm[:, None] * stride_x + kk[None, :], mask=(rm[:, None] < m) & (kk[None, :] < end),
                    other=0.0)
        b = tl.load(w_ptr + rn[None, :] * stride_w + kk[:, None], mask=(rn[None, :] < n) & (kk[:, None] < end),
                    other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    inside = (rm[:, None] < m) & (rn[None, :] < n)
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < n, other=0.0).to(tl.float32)
        tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=inside)
    else:
        tl.store(part_ptr + (part * m + rm[:, None]) * n + rn[None, :], acc, mask=inside)


@triton.jit(do_not_specialize=["m"])
def _sum_parts_kernel(part_ptr, b_ptr, y_ptr, m, n, stride_y, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    acc = tl.load(part_ptr + row * n + cols, mask=inside, other=0.0)
    for p in tl.static_range(1, SPLIT):  # in order: the sum's grouping is the weight's, never the pass's
        acc += tl.load(part_ptr + (p * m + row) * n + cols, mask=inside, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, acc.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["eps"])
def _norm_kernel(x_ptr, d_ptr, w_ptr, s_ptr, y_ptr, n, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    """y = rmsnorm(x (+ d)) of one row; with ADD the sum is also stored in s."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=inside, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(d_ptr + row * n + cols, mask=inside, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(s_ptr + row * n + cols, x, mask=inside)
    h = x.to(tl.float32)
    h = h * (1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n + eps))
    w = tl.load(w_ptr + cols, mask=inside, other=0.0)
    tl.store(y_ptr + row * n + cols, w * h.to(x.dtype), mask=inside)


@triton.jit
def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, rows_ptr, q_ptr, k_ptr, v_ptr,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr):
    """One head of one token: a query rotated into q, a key rotated into the pool, a value copied."""
    t = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, D)
    width = (HEADS + 2 * KV_HEADS) * D
    x = tl.load(qkv_ptr + t * width + head * D + d)
    if head >= HEADS + KV_HEADS:
        row = tl.load(rows_ptr + t)
        tl.store(v_ptr + (row * KV_HEADS + head - HEADS - KV_HEADS) * D + d, x)
    else:
        pos = tl.load(pos_ptr + t)
        half = D // 2
        partner = tl.load(qkv_ptr + t * width + head * D + (d + half) % D).to(tl.float32)
        rotated = tl.where(d < half, -partner, partner)
        out = x.to(tl.float32) * tl.load(cos_ptr + pos * D + d).to(tl.float32) + \
            rotated * tl.load(sin_ptr + pos * D + d).to(tl.float32)
        if head < HEADS:
            tl.store(q_ptr + (t * HEADS + head) * D + d, out.to(x.dtype))
        else:
            row = tl.load(rows_ptr + t)
            tl.store(k_ptr + (row * KV_HEADS + head - HEADS) * D + d, out.to(x.dtype))


@triton.jit
def _silu_mul_kernel(gu_ptr, y_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    gate = tl.load(gu_ptr + row * 2 * n + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * 2 * n + n + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["scale"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, positions, q_start, q_count, past, kv_len, path, tables,
                      stride_path, stride_table, scale,
                      HEADS: tl.constexpr, KV_HEADS: tl.constexpr, REP: tl.constexpr, D: tl.constexpr,
                      PAGE: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    g = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    count = tl.load(q_count + g)
    if tile * BM >= count * REP:
        return
    rows = tile * BM + tl.arange(0, BM)  # (query, head-in-group) pairs
    query = rows // REP
    valid = query < count
    token = tl.load(q_start + g) + query
    head = kv_head * REP + rows % REP
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (token[:, None] * HEADS + head[:, None]) * D + d[None, :], mask=valid[:, None], other=0.0)
    q_pos = tl.load(positions + token, mask=valid, other=-1)
    cached = tl.load(past + g)
    length = tl.load(kv_len + g)
    best = tl.full((BM,), float("-inf"), tl.float32)
    total = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    for start in range(0, length, BN):
        pos = start + tl.arange(0, BN)
        inside = pos < length
        fed = pos >= cached
        step = tl.load(path + g * stride_path + (pos - cached), mask=inside & fed, other=0)
        slot = tl.where(fed, cached + step, pos)
        page = tl.load(tables + g * stride_table + slot // PAGE, mask=inside, other=0)
        row = page.to(tl.int64) * PAGE + slot % PAGE
        k = tl.load(k_ptr + (row[:, None] * KV_HEADS + kv_head) * D + d[None, :], mask=inside[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        visible = (pos[None, :] <= q_pos[:, None]) & inside[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        safe = tl.where(new_best == float("-inf"), 0.0, new_best)
        alpha = tl.exp(best - safe)
        p = tl.exp(scores - safe[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + (row[:, None] * KV_HEADS + kv_head) * D + d[None, :], mask=inside[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        best = new_best
    out = acc / total[:, None]
    tl.store(o_ptr + (token[:, None] * HEADS + head[:, None]) * D + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=valid[:, None])


class TritonOps:
    """The kernels of llama.forward on CUDA. `query_cap`: queries of one group the attention launch
    covers (a CUDA graph's cap; None: each pass's own largest group). `wide`: wide tiles for passes
    of more than SMALL_ROWS rows (only where check_tiles found them bit-identical to narrow ones)."""

    def __init__(self, query_cap: int | None = None, wide: bool = False) -> None:
        self.query_cap = query_cap
        self.wide = wide

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, parts: tuple[int, ...] = (),
               tiles: Tiles | None = None) -> torch.Tensor:
        # `parts` is ignored: one launch over a fused weight is faster on a GPU than one per part.
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
        tiles = tiles or (WIDE if self.wide and m > SMALL_ROWS else NARROW)
        split = split_of(n, k)
        k_part = triton.cdiv(triton.cdiv(k, split), BLOCK_K) * BLOCK_K
        parts = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else y
        grid = (triton.cdiv(m, tiles.rows) * triton.cdiv(n, tiles.cols), split)
        _linear_kernel[grid](x, weight, bias if bias is not None else weight, y, parts, m, n, k, k_part,
                             x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                             IEEE=x.dtype == torch.float32, SPLIT=split, BM=tiles.rows, BN=tiles.cols, BK=BLOCK_K,
                             GROUP=8, num_warps=tiles.warps, num_stages=tiles.stages)
        if split > 1:
            _sum_parts_kernel[(m, triton.cdiv(n, 1024))](parts, bias if bias is not None else weight, y, m, n,
                                                         y.stride(0), HAS_BIAS=bias is not None, SPLIT=split,
                                                         BLOCK=1024, num_warps=4)
        return y

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y = torch.empty_like(x)
        _norm_kernel[(x.shape[0],)](x, x, weight, x, y, x.shape[1], eps, ADD=False,
                                    BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=4)
        return y

    def add_rmsnorm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        total, y = torch.empty_like(x), torch.empty_like(x)
        _norm_kernel[(x.shape[0],)](x, delta, weight, total, y, x.shape[1], eps, ADD=True,
                                    BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=4)
        return total, y

    def rope_and_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, heads: int) -> torch.Tensor:
        t, (kv_heads, dim) = qkv.shape[0], keys.shape[1:]
        q = torch.empty(t, heads, dim, device=qkv.device, dtype=qkv.dtype)
        _rope_cache_kernel[(t, heads + 2 * kv_heads)](qkv, cos, sin, positions, rows, q, keys, values,
                                                      HEADS=heads, KV_HEADS=kv_heads, D=dim, num_warps=1)
        return q

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        t, n = gate_up.shape[0], gate_up.shape[1] // 2
        y = torch.empty(t, n, device=gate_up.device, dtype=gate_up.dtype)
        _silu_mul_kernel[(t, triton.cdiv(n, 1024))](gate_up, y, n, BLOCK=1024, num_warps=4)
        return y

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: GroupTensors,
                  scale: float) -> torch.Tensor:
        t, heads, dim = q.shape
        kv_heads = keys.shape[1]
        rep = heads // kv_heads
        out = torch.empty_like(q)
        queries = self.query_cap or meta.max_queries
        grid = (meta.q_count.shape[0], kv_heads, triton.cdiv(queries * rep, ATTN_BLOCK_M))
        _attention_kernel[grid](q, keys, values, out, meta.positions, meta.q_start, meta.q_count, meta.past,
                                meta.kv_len, meta.path, meta.tables, meta.path.stride(0), meta.tables.stride(0),
                                scale, HEADS=heads, KV_HEADS=kv_heads, REP=rep, D=dim, PAGE=meta.page_tokens,
                                IEEE=q.dtype == torch.float32, BM=ATTN_BLOCK_M, BN=ATTN_BLOCK_N, num_warps=4,
                                num_stages=2)
        return out


def check_tiles(weights: list[torch.Tensor]) -> bool:
    """True when the wide tiles give every row of every weight's product the bits the narrow ones
    do (random rows; the hardware's arithmetic, not the data, decides). Run once per engine."""
    ops = TritonOps()
    gen = torch.Generator(device=weights[0].device).manual_seed(0)
    for w in weights:
        x = torch.randn(2 * SMALL_ROWS + 3, w.shape[1], generator=gen, device=w.device).to(w.dtype)
        if not torch.equal(ops.linear(x, w, tiles=NARROW), ops.linear(x, w, tiles=WIDE)):
            return False
    return True
