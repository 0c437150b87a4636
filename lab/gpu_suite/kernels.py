"""Part (k): the price and the point of batch invariance, per weight matrix of a shape. For each
matrix and row count M: the time of the first Triton products (split: parts of K in fp32 buffers and a
summing kernel), of the current ones (fused: parts summed in the program, tiles chosen at start-up as
an engine chooses them), and of torch's library product (cuBLAS, with split-K turned off through its
workspace when torch_engine set that up before any product ran), and whether each gives a row the
same bits at every M (the library's does not promise it). The engine's choice per matrix is recorded."""
from __future__ import annotations

import torch

from . import models


def products(shape: str, rows: list[int], device: str = "cuda", max_rows: int = 512) -> dict:
    """Per matrix of `shape` (q|k|v, o, gate|up, down, output head) and per M in `rows`; and the choice
    tune_product makes for each ({"rows": [...], "choices": {matrix: description}})."""
    from ...cloud.engine.triton_ops import (NARROW, SMALL_ROWS, WIDE, check_tiles, cuda_ms, fused_product,
                                            split_product, tune_product)

    s = models.SHAPES[shape]
    hidden, inter = s["hidden_size"], s["intermediate_size"]
    head_dim = s.get("head_dim") or hidden // s["num_attention_heads"]
    qkv = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * head_dim
    matrices = {"qkv": (qkv, hidden, None), "o": (hidden, s["num_attention_heads"] * head_dim, None),
                "gate_up": (2 * inter, hidden, None), "down": (hidden, inter, None),
                "head": (s["vocab_size"], hidden, torch.float32)}
    out, choices = [], {}
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n, k, out_dtype) in matrices.items():
        w = (torch.randn(n, k, generator=gen, device=device) * k ** -0.5).to(torch.bfloat16)
        x = torch.randn(max(rows), k, generator=gen, device=device).to(torch.bfloat16)
        choice = tune_product(w, None, out_dtype, False, max_rows)
        choices[name] = choice.describe()
        wide = check_tiles([w])
        kernels = {
            "split": lambda xm: split_product(xm, w, None, out_dtype,
                                              WIDE if wide and len(xm) > SMALL_ROWS else NARROW),
            "fused": lambda xm: fused_product(xm, w, None, out_dtype, False, choice.tiles[_band(len(xm))]),
            "cublas": lambda xm: _library(xm, w, out_dtype, max(rows)),
        }
        full = {kind: fn(x) for kind, fn in kernels.items()}
        for m in rows:
            xm = x[:m].contiguous()
            row = {"matrix": name, "n": n, "k": k, "rows": m}
            for kind, fn in kernels.items():
                row[f"{kind}_ms"] = cuda_ms(lambda: fn(xm), repeats=50)
                row[f"{kind}_rows_invariant"] = bool(torch.equal(fn(xm), full[kind][:m]))
            row["fused_weight_gb_per_s"] = round(n * k * 2 / row["fused_ms"] / 1e6, 1)
            out.append(row)
    return {"rows": out, "choices": choices}


def _library(x: torch.Tensor, w: torch.Tensor, out_dtype, rows: int) -> torch.Tensor:
    """cuBLAS as the engine would call it; where this torch cannot write a bf16 product in float32,
    the bf16 product widened (what the engine then leaves to our kernels)."""
    from ...cloud.engine.triton_ops import cublas_product

    try:
        return cublas_product(x, w, None, out_dtype, rows)
    except (RuntimeError, TypeError):
        return torch.nn.functional.linear(x, w).to(out_dtype)


def _band(m: int) -> int:
    from ...cloud.engine.triton_ops import band_of

    return band_of(m)
