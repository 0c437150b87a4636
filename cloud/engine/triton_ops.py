"""The forward pass's kernels for CUDA, in Triton: batch-invariant by construction, and capturable
in CUDA graphs.

A library matrix product picks its kernel (tile shape, split-K) from the number of rows, so a row's
bits depend on how many other rows share the pass (measured: cuBLAS on an H100 gives the 8B shape's
o and down products other bits at 1-64 rows than at 320; docs/gpu.md). Here a weight's reduction
is fixed by the weight alone: its K range is cut into `split_of(n, k)` equal parts, each walked in
BLOCK_K steps from its start, and the parts are added in order, inside the program that owns the
output tile (no partial sums in memory, no second kernel). A row's result then depends only on that
row and the weight. What may follow the pass's size is everything that leaves those sums alone:
the tile's rows and columns, warps and pipeline depth (`Tiles`), chosen per weight and band of row
counts by timing at start-up (`tune_product`) among the candidates that give every row the reference
tile's very bits on this card. And where a start-up check proves that cuBLAS, with split-K turned
off through its workspace (torch_engine.py sets the variables before any product runs), gives a row
the same bits at every row count from 1 to the largest pass, that weight is multiplied by cuBLAS
instead, at every row count (a pass of more rows is cut into pieces within the proven range).

Fusions that keep each row's arithmetic as it was: SiLU·up is computed in the down product's
prologue (`silu_linear`), exactly as the separate kernel computed and rounded it. The first kernels
(split-K parts written to fp32 buffers and summed by a second kernel, narrow or wide tiles) stay
selectable as `Products.SPLIT`, to compare against. Attention walks each group's key positions in
tiles of BLOCK_N from position 0 (see torch_ops.py for why that keeps a query's sums fixed), reading
keys through the session's page table, and a draft tree node through its root path
(cloud/engine/batch.py). Norms, rotary and SiLU are one program per row.
"""
from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .batch import GroupTensors
from .kinds import Products

BLOCK_K = 64
ATTN_BLOCK_M = 64  # (query, head) rows per attention program
ATTN_BLOCK_N = 64  # key positions per attention step (torch_ops.KEY_CHUNK)
SMS_TO_FILL = 264  # programs a one-row-tile product should reach: two per multiprocessor of an H100
MIN_SPLIT_K = 512  # a part of K shorter than this is not worth cutting
SMALL_ROWS = 64  # the first kernels: passes of at most this many rows use the narrow tiles


@dataclass(frozen=True)
class Tiles:
    """One launch shape of the product kernel. `depth`: columns of K per loop step (a multiple of
    BLOCK_K; on the tensor cores a deeper step issues the same k-steps in the same order, which only
    the start-up bit check can confirm on a card, so deeper steps are candidates like any tile)."""

    rows: int
    cols: int
    warps: int
    stages: int
    depth: int = BLOCK_K


NARROW = Tiles(64, 64, 4, 4)  # decode-sized passes: bound by reading the weight (the reference tile)
WIDE = Tiles(128, 128, 8, 3)  # verify and prefill passes: bound by arithmetic
# A pass of m rows belongs to the first band whose bound is >= m (beyond the last: the last band).
ROW_BANDS = (16, 64, 256, 1024)
# Per band, the tiles timed at start-up (each only if it gives the reference tile's bits). Few rows:
# short tiles, so a one-row product still spreads over the multiprocessors without splitting K.
CANDIDATES: tuple[tuple[Tiles, ...], ...] = (
    (Tiles(16, 32, 4, 4), Tiles(16, 16, 2, 6), Tiles(16, 64, 4, 4, 2 * BLOCK_K)),
    (Tiles(32, 64, 4, 4), NARROW),
    (NARROW, Tiles(64, 128, 4, 3)),
    (Tiles(64, 128, 4, 3), WIDE),
)  # seven tiles in all, each compiled per kernel variant at start-up: more would cost start-up time


def band_of(m: int) -> int:
    """The band of ROW_BANDS a product of m rows belongs to."""
    return min(bisect.bisect_left(ROW_BANDS, m), len(ROW_BANDS) - 1)


def split_of(n: int, k: int) -> int:
    """Parts the reduction over K of an n×k weight is cut into: enough for a one-row-tile product of
    the first kernels to keep the memory system busy, none shorter than MIN_SPLIT_K. Fixed per weight:
    it defines the order of additions every kernel here keeps."""
    split = 1
    while triton.cdiv(n, NARROW.cols) * split < SMS_TO_FILL and k // (2 * split) >= MIN_SPLIT_K:
        split *= 2
    return split


def k_part_of(k: int, split: int) -> int:
    """Columns of K in each part (a whole number of BLOCK_K steps; the last part may be shorter)."""
    return triton.cdiv(triton.cdiv(k, split), BLOCK_K) * BLOCK_K


@triton.jit
def _k_range(x_ptr, w_ptr, rm, rn, m, n, start, end, stride_x, stride_w, up_offset, SILU_UP: tl.constexpr,
             IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """x[rm] @ w[rn].T over K columns [start, end), in BK steps from `start`. With SILU_UP, x holds
    gate|up and the rows multiplied are silu(gate) * up, rounded to x's type as silu_mul rounds them."""
    ks = tl.arange(0, BK)
    # tl.full, not tl.zeros: Triton's interpreter (the CPU tests) loses its patch of library functions
    # such as tl.zeros inside a helper when Triton was imported before interpreting was asked for.
    acc = tl.full((BM, BN), 0.0, tl.float32)
    for s in range(start, end, BK):
        kk = s + ks
        inside = (rm[:, None] < m) & (kk[None, :] < end)
        a = tl.load(x_ptr + rm[:, None] * stride_x + kk[None, :], mask=inside, other=0.0)
        if SILU_UP:
            gate = a.to(tl.float32)
            up = tl.load(x_ptr + rm[:, None] * stride_x + up_offset + kk[None, :], mask=inside, other=0.0)
            a = (gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)).to(x_ptr.dtype.element_ty)
        b = tl.load(w_ptr + rn[None, :] * stride_w + kk[:, None], mask=(rn[None, :] < n) & (kk[:, None] < end),
                    other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _tile_of(pid, m, n, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """The output tile of program `pid`, in grouped order: consecutive programs share a weight column
    tile (it stays in L2)."""
    tiles_m, tiles_n = (m + BM - 1) // BM, (n + BN - 1) // BN
    per_group = GROUP * tiles_n
    first_m = (pid // per_group) * GROUP
    size_m = tl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m * BM + tl.arange(0, BM), pid_n * BN + tl.arange(0, BN)


@triton.jit(do_not_specialize=["m"])
def _product_kernel(x_ptr, w_ptr, b_ptr, y_ptr, m, n, k, k_part, stride_x, stride_w, stride_y, up_offset,
                    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, SILU_UP: tl.constexpr, SPLIT: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    """y = x @ w.T (+ b): each part of K summed on its own from zero, then the parts added in order
    (((p0 + p1) + p2) + ...), then the bias: the first kernels' additions, without their buffers."""
    rm, rn = _tile_of(tl.program_id(0), m, n, BM, BN, GROUP)
    total = _k_range(x_ptr, w_ptr, rm, rn, m, n, 0, tl.minimum(k, k_part), stride_x, stride_w, up_offset,
                     SILU_UP, IEEE, BM, BN, BK)
    for part in range(1, SPLIT):
        total += _k_range(x_ptr, w_ptr, rm, rn, m, n, part * k_part, tl.minimum(k, (part + 1) * k_part), stride_x,
                          stride_w, up_offset, SILU_UP, IEEE, BM, BN, BK)
    if HAS_BIAS:
        total += tl.load(b_ptr + rn, mask=rn < n, other=0.0).to(tl.float32)
    inside = (rm[:, None] < m) & (rn[None, :] < n)
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], total.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["m"])
def _qkv_rope_kernel(x_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, pos_ptr, rows_ptr, q_ptr, k_ptr, v_ptr, m, k, k_part,
                     stride_x, stride_w, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
                     HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                     BH: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    """The q|k|v product with the rotary and the KV write in its epilogue. A program owns BM rows and
    the first and second halves of BH // (D / 2) heads' columns, so it holds both partners of every
    rotated pair; each half is summed as _product_kernel sums a column (the same additions), rounded to
    the product's type, then rotated as _rope_cache_kernel rotates it."""
    HALF = D // 2
    n = (HEADS + 2 * KV_HEADS) * D
    rm, hc = _tile_of(tl.program_id(0), m, n // 2, BM, BH, GROUP)  # hc: half-columns, HALF per head
    head, d = hc // HALF, hc % HALF
    lo = head * D + d
    hi = lo + HALF
    acc_lo = _k_range(x_ptr, w_ptr, rm, lo, m, n, 0, tl.minimum(k, k_part), stride_x, stride_w, 0, False, IEEE,
                      BM, BH, BK)
    acc_hi = _k_range(x_ptr, w_ptr, rm, hi, m, n, 0, tl.minimum(k, k_part), stride_x, stride_w, 0, False, IEEE,
                      BM, BH, BK)
    for part in range(1, SPLIT):
        end = tl.minimum(k, (part + 1) * k_part)
        acc_lo += _k_range(x_ptr, w_ptr, rm, lo, m, n, part * k_part, end, stride_x, stride_w, 0, False, IEEE,
                           BM, BH, BK)
        acc_hi += _k_range(x_ptr, w_ptr, rm, hi, m, n, part * k_part, end, stride_x, stride_w, 0, False, IEEE,
                           BM, BH, BK)
    if HAS_BIAS:
        acc_lo += tl.load(b_ptr + lo, mask=lo < n, other=0.0).to(tl.float32)
        acc_hi += tl.load(b_ptr + hi, mask=hi < n, other=0.0).to(tl.float32)
    x_lo = acc_lo.to(q_ptr.dtype.element_ty)
    x_hi = acc_hi.to(q_ptr.dtype.element_ty)
    inside = rm < m
    pos = tl.load(pos_ptr + rm, mask=inside, other=0)
    row = tl.load(rows_ptr + rm, mask=inside, other=0)
    f_lo, f_hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
    c_lo = tl.load(cos_ptr + pos[:, None] * D + d[None, :]).to(tl.float32)
    s_lo = tl.load(sin_ptr + pos[:, None] * D + d[None, :]).to(tl.float32)
    c_hi = tl.load(cos_ptr + pos[:, None] * D + HALF + d[None, :]).to(tl.float32)
    s_hi = tl.load(sin_ptr + pos[:, None] * D + HALF + d[None, :]).to(tl.float32)
    r_lo = (f_lo * c_lo + (-f_hi) * s_lo).to(q_ptr.dtype.element_ty)
    r_hi = (f_hi * c_hi + f_lo * s_hi).to(q_ptr.dtype.element_ty)
    is_q = inside[:, None] & (head < HEADS)[None, :]
    is_k = inside[:, None] & ((head >= HEADS) & (head < HEADS + KV_HEADS))[None, :]
    is_v = inside[:, None] & ((head >= HEADS + KV_HEADS) & (head < HEADS + 2 * KV_HEADS))[None, :]
    q_at = q_ptr + (rm[:, None] * HEADS + head[None, :]) * D + d[None, :]
    tl.store(q_at, r_lo, mask=is_q)
    tl.store(q_at + HALF, r_hi, mask=is_q)
    k_at = k_ptr + (row[:, None] * KV_HEADS + (head - HEADS)[None, :]) * D + d[None, :]
    tl.store(k_at, r_lo, mask=is_k)
    tl.store(k_at + HALF, r_hi, mask=is_k)
    v_at = v_ptr + (row[:, None] * KV_HEADS + (head - HEADS - KV_HEADS)[None, :]) * D + d[None, :]
    tl.store(v_at, x_lo, mask=is_v)
    tl.store(v_at + HALF, x_hi, mask=is_v)


@triton.jit(do_not_specialize=["m"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, m, n, k, k_part, stride_x, stride_w, stride_y,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    """The first kernels' product: one part of K per program; with SPLIT > 1 the part's fp32 sums go
    to `part_ptr` for _sum_parts_kernel."""
    part = tl.program_id(1)
    rm, rn = _tile_of(tl.program_id(0), m, n, BM, BN, GROUP)
    acc = _k_range(x_ptr, w_ptr, rm, rn, m, n, part * k_part, tl.minimum(k, (part + 1) * k_part), stride_x, stride_w,
                   0, False, IEEE, BM, BN, BK)
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


@dataclass(frozen=True)
class ProductChoice:
    """How one weight is multiplied at every row count: cuBLAS (proven row-invariant up to `rows`
    rows; larger products are cut into pieces of at most that many), or our kernel with the tiles of
    each band of ROW_BANDS."""

    tiles: tuple[Tiles, ...] = (NARROW,) * len(ROW_BANDS)
    cublas_rows: int = 0  # 0: our kernel

    def describe(self) -> str:
        if self.cublas_rows:
            return f"cuBLAS (row-invariant at 1..{self.cublas_rows} rows)"
        return ", ".join(f"≤{b}: {t.rows}×{t.cols}×{t.depth}/{t.warps}w/{t.stages}s"
                         for b, t in zip(ROW_BANDS, self.tiles))


def weight_key(weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None,
               silu_up: bool = False) -> tuple:
    """What a product's choice is kept under: every layer's weight of one shape shares it."""
    return tuple(weight.shape), weight.dtype, bias is not None, out_dtype or weight.dtype, silu_up


class TritonOps:
    """The kernels of llama.forward on CUDA. `query_cap`: queries of one group the attention launch
    covers (a CUDA graph's cap; None: each pass's own largest group). `products`: which product kernels
    run. `plan`: per weight (weight_key), the ProductChoice tune_product made (missing: the reference tile).
    `wide` (Products.SPLIT only): wide tiles for passes of more than SMALL_ROWS rows, where check_tiles
    found them bit-identical to the narrow ones."""

    def __init__(self, query_cap: int | None = None, wide: bool = False, products: Products = Products.FUSED,
                 plan: dict[tuple, ProductChoice] | None = None, fuse_rope: bool = True) -> None:
        self.query_cap = query_cap
        self.wide = wide
        self.products = products
        self.plan = plan if plan is not None else {}
        self.fuse_rope = fuse_rope  # the rotary in the q|k|v product's epilogue (where check_rope_fusion agreed)

    def qkv_rope_cache(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                       sin: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor, heads: int) -> torch.Tensor:
        """rope_and_cache of the q|k|v product of h: one launch where the first kernels took two."""
        choice = self.plan.get(weight_key(weight, bias, None))
        if self.products is Products.SPLIT or not self.fuse_rope or (choice is not None and choice.cublas_rows):
            return self.rope_and_cache(self.linear(h, weight, bias), cos, sin, positions, rows, keys, values, heads)
        tiles = choice.tiles[band_of(h.shape[0])] if choice is not None else NARROW
        return fused_qkv_rope(h, weight, bias, cos, sin, positions, rows, keys, values, heads, tiles)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, parts: tuple[int, ...] = (),
               tiles: Tiles | None = None) -> torch.Tensor:
        # `parts` is ignored: one launch over a fused weight is faster on a GPU than one per part.
        if self.products is Products.SPLIT:
            return split_product(x, weight, bias, out_dtype, tiles or (WIDE if self.wide and x.shape[0] > SMALL_ROWS
                                                                       else NARROW))
        return self._product(x, weight, bias, out_dtype, False, tiles)

    def silu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a fused gate|up product, multiplied by `weight` (the down product): one
        launch, the SiLU in the product's prologue, where the first kernels took two."""
        if self.products is Products.SPLIT:
            return self.linear(self.silu_mul(gate_up), weight)
        return self._product(gate_up, weight, None, None, True, None)

    def _product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype | None, silu_up: bool, tiles: Tiles | None) -> torch.Tensor:
        choice = self.plan.get(weight_key(weight, bias, out_dtype, silu_up))
        if tiles is None and choice is not None and choice.cublas_rows:
            if silu_up:
                x = self.silu_mul(x)
            return cublas_product(x, weight, bias, out_dtype, choice.cublas_rows)
        m = x.shape[0]
        tiles = tiles or (choice.tiles[band_of(m)] if choice is not None else NARROW)
        return fused_product(x, weight, bias, out_dtype, silu_up, tiles)

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


def fused_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None,
                  silu_up: bool, tiles: Tiles) -> torch.Tensor:
    """x @ weight.T (+ bias) in one launch, parts of K summed in the program (silu_up: x is gate|up and
    silu(gate) * up is what is multiplied)."""
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    y = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    split = split_of(n, k)
    grid = (triton.cdiv(m, tiles.rows) * triton.cdiv(n, tiles.cols),)
    _product_kernel[grid](x, weight, bias if bias is not None else weight, y, m, n, k, k_part_of(k, split),
                          x.stride(0), weight.stride(0), y.stride(0), k if silu_up else 0,
                          HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, SILU_UP=silu_up, SPLIT=split,
                          BM=tiles.rows, BN=tiles.cols, BK=tiles.depth, GROUP=8, num_warps=tiles.warps,
                          num_stages=tiles.stages)
    return y


def fused_qkv_rope(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                   sin: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor, heads: int, tiles: Tiles) -> torch.Tensor:
    """The rotated queries [T, heads, D] of h's q|k|v product; rotated keys and values written to the
    pool's rows, in one launch (a program covers at least one head: both halves of its pairs)."""
    m, k = h.shape
    kv_heads, dim = keys.shape[1:]
    n = weight.shape[0]
    q = torch.empty(m, heads, dim, device=h.device, dtype=h.dtype)
    half_cols = max(tiles.cols, dim) // 2  # BH: half-columns per program, a whole number of heads
    split = split_of(n, k)
    grid = (triton.cdiv(m, tiles.rows) * triton.cdiv(n // 2, half_cols),)
    _qkv_rope_kernel[grid](h, weight, bias if bias is not None else weight, cos, sin, positions, rows, q, keys, values,
                           m, k, k_part_of(k, split), h.stride(0), weight.stride(0), HAS_BIAS=bias is not None,
                           IEEE=h.dtype == torch.float32, SPLIT=split, HEADS=heads, KV_HEADS=kv_heads, D=dim,
                           BM=tiles.rows, BH=half_cols, BK=tiles.depth, GROUP=8, num_warps=tiles.warps,
                           num_stages=tiles.stages)
    return q


def check_rope_fusion(weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                      heads: int, kv_heads: int, choice: ProductChoice, seed: int = 0) -> bool:
    """True when the fused q|k|v + rotary gives the queries, keys and values the two kernels give (the
    reference tile's product, then _rope_cache_kernel), bit for bit, with every band's tiles of `choice`
    (random rows at random positions; the compiler's arithmetic, not the data, decides)."""
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    m, dim = 2 * SMALL_ROWS + 3, cos.shape[1]
    h = torch.randn(m, weight.shape[1], generator=gen, device=weight.device).to(weight.dtype)
    positions = torch.randint(0, cos.shape[0], (m,), generator=gen, device=weight.device)
    rows = torch.randperm(m, generator=gen, device=weight.device)

    def run(fn) -> list[torch.Tensor]:
        keys = torch.zeros(m, kv_heads, dim, device=weight.device, dtype=weight.dtype)
        values = torch.zeros_like(keys)
        return [fn(keys, values), keys, values]

    ops = TritonOps()
    reference = run(lambda kk, vv: ops.rope_and_cache(fused_product(h, weight, bias, None, False, NARROW), cos, sin,
                                                      positions, rows, kk, vv, heads))
    for tiles in set(choice.tiles):
        fused = run(lambda kk, vv: fused_qkv_rope(h, weight, bias, cos, sin, positions, rows, kk, vv, heads, tiles))
        if not all(torch.equal(a, b) for a, b in zip(fused, reference)):
            return False
    return True


def split_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None,
                  tiles: Tiles) -> torch.Tensor:
    """The first kernels' x @ weight.T (+ bias): a program per tile and part of K, the parts' fp32 sums
    in a buffer added by a second kernel (the same additions as fused_product)."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    split = split_of(n, k)
    parts = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else y
    grid = (triton.cdiv(m, tiles.rows) * triton.cdiv(n, tiles.cols), split)
    _linear_kernel[grid](x, weight, bias if bias is not None else weight, y, parts, m, n, k, k_part_of(k, split),
                         x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                         IEEE=x.dtype == torch.float32, SPLIT=split, BM=tiles.rows, BN=tiles.cols, BK=BLOCK_K,
                         GROUP=8, num_warps=tiles.warps, num_stages=tiles.stages)
    if split > 1:
        _sum_parts_kernel[(m, triton.cdiv(n, 1024))](parts, bias if bias is not None else weight, y, m, n,
                                                     y.stride(0), HAS_BIAS=bias is not None, SPLIT=split,
                                                     BLOCK=1024, num_warps=4)
    return y


def cublas_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None,
                   rows: int) -> torch.Tensor:
    """x @ weight.T (+ bias) by torch's library, in pieces of at most `rows` rows: the row counts a
    start-up check proved give every row the same bits."""
    if x.shape[0] > rows:
        return torch.cat([cublas_product(x[i:i + rows], weight, bias, out_dtype, rows)
                          for i in range(0, x.shape[0], rows)])
    if out_dtype is not None and out_dtype != x.dtype:
        y = torch.mm(x, weight.t(), out_dtype=out_dtype)
        return y if bias is None else y + bias.to(out_dtype)
    return torch.nn.functional.linear(x, weight, bias)


def rows_invariant(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """True when `product` gives every row of x[:m] the bits it gives that row among all of x, for every
    m from 1 to len(x), and for rows that start elsewhere in memory (every 7th m from row 3). One
    device-to-host copy at the end: the comparisons queue on the device."""
    full = product(x)
    bad = torch.zeros((), dtype=torch.bool, device=x.device)
    for m in range(1, x.shape[0] + 1):
        bad |= (product(x[:m]) != full[:m]).any()
    shifted = x[3:].clone()
    for m in range(1, shifted.shape[0] + 1, 7):
        bad |= (product(shifted[:m]) != full[3:3 + m]).any()
    return not bool(bad)


def choose_product(equal: dict[Tiles, bool], triton_ms: dict[tuple[int, Tiles], float],
                   cublas_ms: dict[int, float] | None, cublas_rows: int) -> ProductChoice:
    """The choice from start-up measurements: per band the fastest candidate tile among those `equal`
    (same bits as the reference tile; the reference itself where none was timed), then cuBLAS instead
    when it was proven row-invariant (`cublas_ms` not None) and its times summed over the bands beat
    our chosen tiles' (the bands at once: a weight cannot mix the two, their bits differ)."""
    tiles = []
    for band, candidates in enumerate(CANDIDATES):
        timed = [(triton_ms[(band, t)], i, t) for i, t in enumerate(candidates)
                 if equal.get(t) and (band, t) in triton_ms]
        tiles.append(min(timed)[2] if timed else NARROW)
    ours = [triton_ms.get((band, t)) for band, t in enumerate(tiles)]
    if cublas_ms is not None and all(v is not None for v in ours) and len(cublas_ms) == len(tiles) \
            and sum(cublas_ms.values()) < sum(ours):
        return ProductChoice(tuple(tiles), cublas_rows)
    return ProductChoice(tuple(tiles))


def cuda_ms(fn: Callable[[], object], repeats: int = 10) -> float:
    """Median time of `fn` on the device (CUDA events), after a warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def tune_product(weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 silu_up: bool = False, max_rows: int = 0, time_ms: Callable[[Callable[[], object]], float] = cuda_ms,
                 seed: int = 0) -> ProductChoice:
    """Measure and choose how `weight` is multiplied (see choose_product): every candidate tile's bits
    against the reference tile's on 2 × 64 + 3 random rows, each band's candidates timed at the band's
    largest row count, and, with `max_rows`, cuBLAS checked for row invariance at 1..max_rows rows and
    timed. On a CPU (Triton's interpreter) the same code runs; only its timings mean nothing."""
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    k_in = 2 * weight.shape[1] if silu_up else weight.shape[1]
    rows = max(2 * SMALL_ROWS + 3, max(ROW_BANDS), max_rows)
    x = torch.randn(rows, k_in, generator=gen, device=weight.device).to(weight.dtype)

    def ours(t: Tiles, m: int) -> Callable[[], torch.Tensor]:
        return lambda: fused_product(x[:m], weight, bias, out_dtype, silu_up, t)

    reference = ours(NARROW, 2 * SMALL_ROWS + 3)()
    equal = {t: bool(torch.equal(ours(t, 2 * SMALL_ROWS + 3)(), reference)) for band in CANDIDATES for t in band}
    triton_ms = {(b, t): time_ms(ours(t, ROW_BANDS[b])) for b, band in enumerate(CANDIDATES) for t in band if equal[t]}
    cublas_ms = None
    if max_rows and weight.is_cuda:
        use_invariant_library()
        library = lambda xs: cublas_product(silu_mul_reference(xs) if silu_up else xs, weight, bias,  # noqa: E731
                                            out_dtype, max_rows)
        try:
            proven = rows_invariant(library, x[:max_rows])
        except (RuntimeError, TypeError):  # e.g. this torch cannot write a bf16 product in float32
            proven = False
        if proven:
            cublas_ms = {b: time_ms(lambda m=m: library(x[:m])) for b, m in enumerate(ROW_BANDS)}
    return choose_product(equal, triton_ms, cublas_ms, max_rows)


def use_invariant_library() -> None:
    """Ask torch for the library setup vLLM's batch-invariant mode uses on Hopper: cuBLASLt, and no
    reduced-precision reductions in bf16 products (the workspace that turns split-K off is set by
    torch_engine before any product). Process-wide; the row-invariance check proves what it gives."""
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.preferred_blas_library("cublaslt")


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up as the one-row-per-program kernel computes it (for the cuBLAS down product)."""
    return TritonOps().silu_mul(gate_up)


def check_tiles(weights: list[torch.Tensor]) -> bool:
    """The first kernels: True when the wide tiles give every row of every weight's product the bits
    the narrow ones do (random rows; the hardware's arithmetic, not the data, decides). Once per engine."""
    gen = torch.Generator(device=weights[0].device).manual_seed(0)
    for w in weights:
        x = torch.randn(2 * SMALL_ROWS + 3, w.shape[1], generator=gen, device=w.device).to(w.dtype)
        if not torch.equal(split_product(x, w, None, None, NARROW), split_product(x, w, None, None, WIDE)):
            return False
    return True
