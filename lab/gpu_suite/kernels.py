"""Part (k): the price and the point of batch invariance, per weight matrix of a shape. For each
matrix and row count M: the time of our Triton product and of torch's library product (cuBLAS),
and whether each gives a row the same bits at every M (the library's does not promise it)."""
from __future__ import annotations

import torch

from . import models


def _time_ms(fn, repeats: int = 50) -> float:
    """Median of `repeats` timed calls (CUDA events), after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def products(shape: str, rows: list[int], device: str = "cuda") -> list[dict]:
    """Per matrix of `shape` (q|k|v, o, gate|up, down, output head) and per M in `rows`."""
    from ...cloud.engine.triton_ops import TritonOps

    s = models.SHAPES[shape]
    hidden, inter = s["hidden_size"], s["intermediate_size"]
    head_dim = s.get("head_dim") or hidden // s["num_attention_heads"]
    qkv = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * head_dim
    matrices = {"qkv": (qkv, hidden), "o": (hidden, s["num_attention_heads"] * head_dim),
                "gate_up": (2 * inter, hidden), "down": (hidden, inter), "head": (s["vocab_size"], hidden)}
    ops, out = TritonOps(), []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in matrices.items():
        w = (torch.randn(n, k, generator=gen, device=device) * k ** -0.5).to(torch.bfloat16)
        x = torch.randn(max(rows), k, generator=gen, device=device).to(torch.bfloat16)
        full = {"triton": ops.linear(x, w), "cublas": torch.nn.functional.linear(x, w)}
        for m in rows:
            xm = x[:m].contiguous()
            out.append({"matrix": name, "n": n, "k": k, "rows": m,
                        "triton_ms": _time_ms(lambda: ops.linear(xm, w)),
                        "cublas_ms": _time_ms(lambda: torch.nn.functional.linear(xm, w)),
                        "triton_rows_invariant": bool(torch.equal(ops.linear(xm, w), full["triton"][:m])),
                        "cublas_rows_invariant": bool(torch.equal(torch.nn.functional.linear(xm, w),
                                                                  full["cublas"][:m])),
                        "weight_gb_per_s_triton": None})
            row = out[-1]
            row["weight_gb_per_s_triton"] = round(n * k * 2 / row["triton_ms"] / 1e6, 1)
    return out
