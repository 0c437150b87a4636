"""The CUDA engine's product kernels, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1) on
tiny shapes: a row's output bits do not depend on how many rows share the product nor on the tile,
the parts of K are added in the order the first kernels added them, the SiLU prologue computes what
silu_mul computed, the results are within rounding of a float64 product, and the start-up choice
(tiles, cuBLAS) follows its measurements. Skipped where Triton is not installed (CI installs none:
the CPU engine runs plain torch).

The interpreter multiplies 16-bit floats only as float16 (its dot treats bfloat16 storage as integers),
so float32 and float16 stand in for the GPU's bfloat16 here; on a GPU the start-up checks
(`tune_product`, `check_tiles`) and the suite's exactness part test bfloat16 on the card itself.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (CPU machines and CI run the torch kernels)")
# Triton reads TRITON_INTERPRET when it and its library functions are first imported, and torch imports
# Triton early (the suite's conftest already has), so interpreting must be asked for at process start:
# without it, tests/test_triton_interpreter.py runs this module in a process that has it.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not INTERPRETING, reason="run under TRITON_INTERPRET=1 by "
                                "tests/test_triton_interpreter.py")

from hybridspec.cloud.engine import triton_ops as T  # noqa: E402
from hybridspec.cloud.engine.kinds import Products  # noqa: E402
from hybridspec.cloud.engine.llama import random_weights  # noqa: E402
from hybridspec.cloud.engine.torch_engine import EngineOptions, Kernels, TorchEngine  # noqa: E402
from hybridspec.cloud.engine.torch_ops import TorchOps  # noqa: E402

DTYPES = (torch.float32, torch.float16)
SMALL, LARGE = T.Tiles(16, 32, 4, 4), T.Tiles(32, 64, 4, 4)


def _rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(48, 80), (40, 1100)])  # one part of K; two (split_of cuts 1,100 columns in 2)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_nor_on_the_tile(dtype, n, k):
    w, x = _rand(n, k, dtype=dtype, seed=1), _rand(37, k, dtype=dtype, seed=2)
    full = T.fused_product(x, w, None, None, False, SMALL)
    for m in (1, 3, 17):
        assert torch.equal(T.fused_product(x[:m].contiguous(), w, None, None, False, SMALL), full[:m])
        assert torch.equal(T.fused_product(x[m:].contiguous(), w, None, None, False, SMALL), full[m:])
    assert torch.equal(T.fused_product(x, w, None, None, False, LARGE), full)
    assert torch.equal(T.fused_product(x, w, None, None, False, T.NARROW), full)
    exact = x.double() @ w.double().T
    assert torch.allclose(full.double(), exact, rtol=0, atol=1e-5 if dtype is torch.float32 else 4e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_parts_are_added_in_the_first_kernels_order_without_their_buffers(dtype):
    n, k = 40, 2100
    assert T.split_of(n, k) == 4
    w, x, bias = _rand(n, k, dtype=dtype, seed=3), _rand(9, k, dtype=dtype, seed=4), _rand(n, dtype=dtype, seed=5)
    fused = T.fused_product(x, w, bias, torch.float32, False, SMALL)
    assert torch.equal(fused, T.split_product(x, w, bias, torch.float32, SMALL))
    # Another order of the same additions (one walk over all of K) gives other bits: the order is what is kept.
    one_walk = x.float() @ w.float().T + bias.float() if dtype is torch.float32 else None
    if one_walk is not None:
        assert not torch.equal(fused, one_walk)
    assert torch.allclose(fused.double(), x.double() @ w.double().T + bias.double(), rtol=0, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_silu_prologue_multiplies_what_silu_mul_computes(dtype):
    inter, hidden = 1100, 24
    gate_up, down = _rand(11, 2 * inter, dtype=dtype, seed=6) * 30, _rand(hidden, inter, dtype=dtype, seed=7)
    ops = T.TritonOps()
    separate = T.fused_product(ops.silu_mul(gate_up), down, None, None, False, SMALL)
    assert torch.equal(ops.silu_linear(gate_up, down), separate)
    assert torch.equal(T.fused_product(gate_up[:1].contiguous(), down, None, None, True, LARGE), separate[:1])
    split_ops = T.TritonOps(products=T.Products.SPLIT)
    assert torch.equal(split_ops.silu_linear(gate_up, down), T.split_product(ops.silu_mul(gate_up), down, None, None,
                                                                              T.NARROW))
    reference = TorchOps(1).silu_linear(gate_up.double(), down.double())
    assert torch.allclose(separate.double(), reference, rtol=0, atol=1e-4 if dtype is torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_the_rotary_in_the_qkv_epilogue_writes_what_the_two_kernels_write(dtype, bias):
    heads, kv_heads, dim, hidden, m = 4, 2, 16, 1100, 21  # 1,100 columns of K: two parts
    n = (heads + 2 * kv_heads) * dim
    w, h = _rand(n, hidden, dtype=dtype, seed=12), _rand(m, hidden, dtype=dtype, seed=13) * 4
    b = _rand(n, dtype=dtype, seed=14) if bias else None
    angles = torch.arange(64)[:, None] * torch.linspace(0.1, 1.0, dim // 2)[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, 1).to(dtype), torch.cat([angles.sin()] * 2, 1).to(dtype)
    positions = torch.randint(0, 64, (m,), generator=torch.Generator().manual_seed(15))
    rows = torch.randperm(40, generator=torch.Generator().manual_seed(16))[:m]
    ops = T.TritonOps()

    def pool():
        return torch.zeros(40, kv_heads, dim, dtype=dtype), torch.zeros(40, kv_heads, dim, dtype=dtype)

    (k1, v1), (k2, v2) = pool(), pool()
    q1 = ops.rope_and_cache(T.fused_product(h, w, b, None, False, SMALL), cos, sin, positions, rows, k1, v1, heads)
    q2 = ops.qkv_rope_cache(h, w, b, cos, sin, positions, rows, k2, v2, heads)
    assert torch.equal(q1, q2) and torch.equal(k1, k2) and torch.equal(v1, v2)
    assert k1[rows].abs().sum() > 0 and v1[rows].abs().sum() > 0  # every row written
    k3, v3 = pool()  # one row alone, on other tiles: its bits again
    q3 = T.fused_qkv_rope(h[3:4].contiguous(), w, b, cos, sin, positions[3:4].contiguous(), rows[3:4].contiguous(), k3,
                          v3, heads, LARGE)
    assert torch.equal(q3, q2[3:4]) and torch.equal(k3[rows[3]], k2[rows[3]]) and torch.equal(v3[rows[3]], v2[rows[3]])
    choice = T.ProductChoice((SMALL, LARGE, T.NARROW, T.NARROW))
    assert T.check_rope_fusion(w, b, cos, sin, heads, kv_heads, choice)
    reference = TorchOps(1).qkv_rope_cache(h.double(), w.double(), None if b is None else b.double(), cos.double(),
                                           sin.double(), positions, rows, torch.zeros(40, kv_heads, dim, dtype=torch.float64),
                                           torch.zeros(40, kv_heads, dim, dtype=torch.float64), heads)
    assert torch.allclose(q2.double(), reference, rtol=0, atol=1e-4 if dtype is torch.float32 else 2e-2)


def test_the_choice_takes_the_fastest_tile_with_the_reference_bits_and_cublas_only_when_it_wins():
    fast, slow = T.CANDIDATES[0][0], T.CANDIDATES[0][1]
    times = {(b, t): 10.0 for b, band in enumerate(T.CANDIDATES) for t in band}
    times[(0, fast)], times[(0, slow)] = 1.0, 2.0
    equal = {t: True for band in T.CANDIDATES for t in band}
    assert T.choose_product(equal, times, None, 0).tiles[0] == fast
    equal[fast] = False  # other bits than the reference tile: never used, however fast
    choice = T.choose_product(equal, times, None, 0)
    assert choice.tiles[0] == slow and not choice.cublas_rows
    ours = sum(times[(b, t)] for b, t in enumerate(choice.tiles))
    assert T.choose_product(equal, times, {b: ours / 4 - 0.1 for b in range(4)}, 512).cublas_rows == 512
    assert T.choose_product(equal, times, {b: ours / 4 + 0.1 for b in range(4)}, 512).cublas_rows == 0
    assert T.choose_product({}, {}, None, 0).tiles == (T.NARROW,) * len(T.ROW_BANDS)
    assert [T.band_of(m) for m in (1, 16, 17, 64, 65, 256, 257, 1024, 5000)] == [0, 0, 1, 1, 2, 2, 3, 3, 3]


def test_start_up_tuning_chooses_only_tiles_that_give_the_reference_bits():
    w = _rand(40, 1100, dtype=torch.float32, seed=8)
    timer = iter(range(1000, 0, -1))  # every later candidate "faster": the last bit-equal one wins
    choice = T.tune_product(w, time_ms=lambda fn: float(next(timer)))
    x = _rand(70, 1100, dtype=torch.float32, seed=9)
    reference = T.fused_product(x, w, None, None, False, T.NARROW)
    for band, tiles in enumerate(choice.tiles):
        assert tiles in T.CANDIDATES[band]
        assert torch.equal(T.fused_product(x, w, None, None, False, tiles), reference)
    # The interpreter sums a 128-deep step before adding it to the running sum (a GPU's tensor cores
    # add its 16-deep steps one by one): other bits here, so that candidate is never chosen, however fast.
    deep = T.CANDIDATES[0][-1]
    assert deep.depth == 128 and not torch.equal(T.fused_product(x, w, None, None, False, deep), reference)
    assert choice.tiles[0] != deep
    ops = T.TritonOps(plan={T.weight_key(w, None, None): choice})
    assert torch.equal(ops.linear(x, w), reference)


def test_row_invariance_is_proven_only_for_a_product_that_keeps_every_rows_bits():
    x = _rand(40, 16, dtype=torch.float32, seed=10)
    w = _rand(8, 16, dtype=torch.float32, seed=11)
    assert T.rows_invariant(lambda xs: T.fused_product(xs, w, None, None, False, SMALL), x)
    # A product whose rows change with the pass's size (as a library's kernel choice can make them).
    assert not T.rows_invariant(lambda xs: xs @ w.T + (len(xs) > 20) * 1e-7, x)
    # Large products are cut into proven pieces: the same bits as one call per piece.
    assert torch.equal(T.cublas_product(x, w, None, None, 16), torch.cat([x[i:i + 16] @ w.T for i in (0, 16, 32)]))


@pytest.mark.parametrize("products", list(Products))
def test_the_engine_on_these_kernels_scores_a_token_the_same_bits_wherever_it_sits(products):
    """The whole forward through TritonOps (both product paths), on a tiny random model in float32."""
    from transformers import LlamaConfig

    from test_torch_engine import check_placements

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=1100, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    engine = TorchEngine(random_weights(config, 512, torch.float32, "cpu"), 1024, graphs=False,
                         kernels=Kernels.TRITON, options=EngineOptions(products=products, tune=False))
    assert engine.products == ({} if products is Products.SPLIT else
                               {**{name: T.ProductChoice().describe() for name in ("qkv", "o", "gate_up", "down", "head")},
                                "rotary": "in the q|k|v product's epilogue"})
    check_placements(engine, config.vocab_size, seed=5)
