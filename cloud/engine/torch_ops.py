"""The forward pass's kernels in plain torch (the CPU's; cloud/engine/triton_ops.py has CUDA's): on a
CPU every row is computed the same way whatever else the pass carries.

Two things could make a token's scores depend on its company, and both are closed here:
- A matrix library computes a product of a few rows by a different code path than one of many
  (MKL on an AVX2 machine: 1-3 rows differ from 4 or more in the last bits). `row_floor` finds, once
  per engine, the fewest rows from which every product of the model's shapes gives each row the same
  bits; the engine pads every pass to at least that many rows, and attention pads each group's queries.
- A reduction's order can follow its length. Attention therefore walks the keys in fixed chunks of
  KEY_CHUNK positions from position 0 with an online softmax, so a query's sums see the same keys in
  the same chunks whether the pass reads 40 positions or 400 (chunks past a query are all masked and
  leave its sums unchanged: max(m, -inf) = m, exp(0) = 1, adding 0).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import GroupTensors

KEY_CHUNK = 64  # positions of keys per attention step (the GPU kernel's tile too)
PROBE_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)  # row counts `row_floor` compares
PROBE_REFERENCE = 64


def row_floor(shapes: list[tuple[int, int]], head_dim: int, dtype: torch.dtype) -> int:
    """The fewest rows from which a product gives every row the bits it has among 64 rows: for
    x[m, k] @ w[n, k]^T with each (n, k) in `shapes`, and for attention's batched products (queries
    by a chunk of keys, weights by a chunk of values). 64 when no probed count is enough."""
    gen = torch.Generator().manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(dtype)

    products = [(rand(PROBE_REFERENCE, k), lambda x, w=rand(n, k): F.linear(x, w)) for n, k in shapes]
    products += [(rand(2, 3, PROBE_REFERENCE, head_dim), lambda x, w=rand(2, 3, head_dim, KEY_CHUNK): x @ w),
                 (rand(2, 3, PROBE_REFERENCE, KEY_CHUNK), lambda x, w=rand(2, 3, KEY_CHUNK, head_dim): x @ w)]
    counts = (*PROBE_ROWS, PROBE_REFERENCE)
    floor = 0  # index into counts
    for x, product in products:
        reference = product(x)
        for i in range(floor, len(PROBE_ROWS)):
            m = counts[i]
            if not all(torch.equal(product(x[..., o:o + m, :]), reference[..., o:o + m, :]) for o in (0, 7)):
                floor = i + 1
    return counts[floor]


class TorchOps:
    """The kernels of llama.forward in torch; `rows` is the engine's row floor (1 where no probe ran)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, parts: tuple[int, ...] = ()) -> torch.Tensor:
        # The engine pads every pass to `rows` rows. Fused matrices are multiplied part by part:
        # MKL is 10-35 % slower on the fused q|k|v and gate|up of a 135M model than on their parts.
        if len(parts) > 1:
            weights = weight.split(parts)
            biases = bias.split(parts) if bias is not None else [None] * len(parts)
            out = torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)
        else:
            out = F.linear(x, weight, bias)
        return out if out_dtype is None else out.to(out_dtype)

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """As Hugging Face's LlamaRMSNorm: in float32, then back to x's dtype before the weight."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rmsnorm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + delta
        return x, self.rmsnorm(x, weight, eps)

    def rope_and_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, heads: int) -> torch.Tensor:
        t, (kv_heads, dim) = qkv.shape[0], keys.shape[1:]
        cos, sin = cos[positions][:, None], sin[positions][:, None]
        q = _rotate(qkv[:, :heads * dim].view(t, heads, dim), cos, sin)
        keys.index_copy_(0, rows, _rotate(qkv[:, heads * dim:(heads + kv_heads) * dim].view(t, kv_heads, dim), cos, sin))
        values.index_copy_(0, rows, qkv[:, (heads + kv_heads) * dim:].view(t, kv_heads, dim))
        return q

    def qkv_rope_cache(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                       sin: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor, heads: int) -> torch.Tensor:
        kv = keys.shape[1] * keys.shape[2]
        qkv = self.linear(h, weight, bias, parts=(weight.shape[0] - 2 * kv, kv, kv))
        return self.rope_and_cache(qkv, cos, sin, positions, rows, keys, values, heads)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def silu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.linear(self.silu_mul(gate_up), weight)

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: GroupTensors,
                  scale: float) -> torch.Tensor:
        """q [T, heads, D] attended over each group's keys in `keys`/`values` [rows, kv_heads, D]."""
        t, heads, dim = q.shape
        kv_heads = keys.shape[1]
        rep = heads // kv_heads
        layout = meta.cache.get("torch") or meta.cache.setdefault("torch", _Layout(meta, t, self.rows))
        groups, width = layout.groups, layout.width
        # 1. Each group's queries, padded to `width`: [G, kv_heads, width * rep, D], rows = (query, rep).
        qg = q[layout.q_index].view(groups, width, kv_heads, rep, dim).permute(0, 2, 1, 3, 4)
        qg = qg.reshape(groups, kv_heads, width * rep, dim)
        # 2. Online softmax over fixed chunks of key positions.
        best = torch.full((groups, kv_heads, width * rep, 1), float("-inf"), device=q.device)
        total = torch.zeros(groups, kv_heads, width * rep, 1, device=q.device)
        acc = torch.zeros(groups, kv_heads, width * rep, dim, device=q.device)
        for rows, hidden in layout.chunks(rep):
            k = keys.index_select(0, rows).view(groups, KEY_CHUNK, kv_heads, dim).permute(0, 2, 3, 1)  # [G, kv, D, C]
            v = values.index_select(0, rows).view(groups, KEY_CHUNK, kv_heads, dim).permute(0, 2, 1, 3)  # [G, kv, C, D]
            scores = (torch.matmul(qg, k).float() * scale).masked_fill_(hidden, float("-inf"))
            new_best = torch.maximum(best, scores.amax(-1, keepdim=True))
            safe = torch.where(new_best == float("-inf"), 0.0, new_best)
            alpha = torch.exp(best - safe)
            p = torch.exp(scores - safe)
            total = total * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p.to(v.dtype), v).float()
            best = new_best
        out = (acc / total).to(q.dtype)  # [G, kv_heads, width * rep, D]
        # 3. Back to the packed order (padding queries dropped).
        out = out.view(groups, kv_heads, width, rep, dim).permute(0, 2, 1, 3, 4).reshape(groups, width, heads, dim)
        result = torch.zeros_like(q)
        result[layout.q_index[layout.q_valid]] = out[layout.q_valid]
        return result


class _Layout:
    """Where each group's queries sit and which pool rows each chunk of its keys reads: the same for
    every layer of a pass, so worked out once (kept in the pass's GroupTensors.cache)."""

    def __init__(self, meta: GroupTensors, tokens: int, min_rows: int) -> None:
        device = meta.q_count.device
        self.groups = int((meta.q_count > 0).sum())
        self.width = max(meta.max_queries, min_rows)
        offsets = torch.arange(self.width, device=device)
        self.q_index = (meta.q_start[:self.groups, None] + offsets).clamp(max=tokens - 1)
        self.q_valid = offsets < meta.q_count[:self.groups, None]
        self.q_pos = torch.where(self.q_valid, meta.positions[self.q_index], -1)
        past, kv_len = meta.past[:self.groups, None], meta.kv_len[:self.groups, None]
        self._rows, self._positions, self._inside = [], [], []
        for start in range(0, meta.max_len, KEY_CHUNK):
            pos = torch.arange(start, start + KEY_CHUNK, device=device)[None, :]  # [1, C]
            inside = pos < kv_len
            step = torch.gather(meta.path[:self.groups], 1, (pos - past).clamp(0, meta.path.shape[1] - 1))
            slot = torch.where(pos >= past, past + step, pos)
            page = torch.gather(meta.tables[:self.groups].long(), 1, torch.where(inside, slot, 0) // meta.page_tokens)
            self._rows.append(torch.where(inside, page * meta.page_tokens + slot % meta.page_tokens, 0).reshape(-1))
            self._positions.append(pos)
            self._inside.append(inside)
        self._hidden: dict[int, list[torch.Tensor]] = {}

    def chunks(self, rep: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per chunk: the pool rows of its keys ([G * C]) and which (query row, key) pairs are masked
        ([G, 1, width * rep, C]: a key after the query's position, or past the group's keys)."""
        if rep not in self._hidden:
            row_pos = self.q_pos.repeat_interleave(rep, dim=1)[:, None, :, None]
            self._hidden[rep] = [~((pos[:, None, None, :] <= row_pos) & inside[:, None, None, :])
                                 for pos, inside in zip(self._positions, self._inside)]
        return list(zip(self._rows, self._hidden[rep]))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, written as Hugging Face writes it (x cos + rotate_half(x) sin)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
