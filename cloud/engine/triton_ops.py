"""The forward pass's kernels for CUDA, in Triton: batch-invariant by construction, and capturable
in CUDA graphs.

A library matrix product picks its kernel (tile shape, split-K) from the number of rows, so a row's
bits depend on how many other rows share the pass. These kernels fix the tiling per weight: a row
tile of BLOCK_M rows, a column tile chosen from the weight's shape alone, and the reduction walked
in BLOCK_K steps from the first column, one program per output tile, no split. A row's result then
depends only on that row and the weight. Attention walks each group's key positions in tiles of
BLOCK_N from position 0 (see torch_ops.py for why that keeps a query's sums fixed), reading the keys
through the session's page table, and a draft tree node through its root path (cloud/engine/batch.py).
RMSNorm is one program per row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .batch import GroupTensors

BLOCK_M = 64  # rows per product tile: Hopper's warp-group MMA is 64 rows tall
BLOCK_K = 64
ATTN_BLOCK_M = 64  # (query, head) rows per attention program
ATTN_BLOCK_N = 64  # key positions per attention step (torch_ops.KEY_CHUNK)
SMS_TO_FILL = 132  # an H100's multiprocessors: a one-tile-tall product should reach about twice this


def column_block(n: int) -> int:
    """The column tile of an n-column weight: the widest that still gives a one-row-tile product
    enough programs to keep the GPU's memory system busy (decode is bound by reading the weights)."""
    for block in (128, 64, 32):
        if triton.cdiv(n, block) >= 2 * SMS_TO_FILL:
            return block
    return 32


@triton.jit(do_not_specialize=["m"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, m, n, k, stride_x, stride_w, stride_y,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(m, BM), tl.cdiv(n, BN)
    # Grouped order: consecutive programs share a weight column tile (it stays in L2).
    per_group = GROUP * tiles_n
    first_m = (pid // per_group) * GROUP
    size_m = tl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    x_ptrs = x_ptr + rm[:, None] * stride_x + rk[None, :]
    w_ptrs = w_ptr + rn[None, :] * stride_w + rk[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for start in range(0, k, BK):
        a = tl.load(x_ptrs, mask=(rm[:, None] < m) & (rk[None, :] < k - start), other=0.0)
        b = tl.load(w_ptrs, mask=(rn[None, :] < n) & (rk[:, None] < k - start), other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BK
        w_ptrs += BK
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < n, other=0.0).to(tl.float32)
    y_ptrs = y_ptr + rm[:, None] * stride_y + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < m) & (rn[None, :] < n))


@triton.jit(do_not_specialize=["eps"])
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, n, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    h = x.to(tl.float32)
    h = h * (1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n + eps))
    w = tl.load(w_ptr + cols, mask=inside, other=0.0)
    tl.store(y_ptr + row * stride_y + cols, w * h.to(x.dtype), mask=inside)


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
    covers (a CUDA graph's cap; None: each pass's own largest group)."""

    def __init__(self, query_cap: int | None = None) -> None:
        self.query_cap = query_cap

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
        bn = column_block(n)
        grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, bn),)
        _linear_kernel[grid](x, weight, bias if bias is not None else weight, y, m, n, k,
                             x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                             IEEE=x.dtype == torch.float32, BM=BLOCK_M, BN=bn, BK=BLOCK_K, GROUP=8,
                             num_warps=4, num_stages=4)
        return y

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows, n = x.shape
        y = torch.empty_like(x)
        _rmsnorm_kernel[(rows,)](x, weight, y, n, x.stride(0), y.stride(0), eps,
                                 BLOCK=triton.next_power_of_2(n), num_warps=4)
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
                                IEEE=q.dtype == torch.float32, BM=ATTN_BLOCK_M, BN=ATTN_BLOCK_N, num_warps=4, num_stages=2)
        return out
