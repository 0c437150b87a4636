"""Every CUDA kernel of the engine compiles for a Hopper GPU (sm_90) on this CPU machine: Triton
builds the PTX and its bundled ptxas assembles it, no GPU needed. A kernel that only a GPU run could
find broken (a constexpr passed where the compiler wants a value, a shape tl.dot refuses) fails here
instead of spending a GPU session's minutes. One tile per kernel variant the engine launches (8B
shape: parts of K 1, 4 and 8, the SiLU prologue, a float32 output, the rotary epilogue with and
without biases); the interpreter tests (test_triton_kernels.py) check what the kernels compute.
Skipped without Triton, and in a process that interprets (its kernels are not compilable objects)."""
from __future__ import annotations

import inspect
import os

import pytest

triton = pytest.importorskip("triton", reason="Triton is not installed (CPU machines and CI run the torch kernels)")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreted kernels do not compile")

from hybridspec.cloud.engine import triton_ops as T  # noqa: E402

HOPPER = (90, 32)  # compute capability, warp size


def _compile(kernel, types: dict[str, str], constants: dict, warps: int = 4, stages: int = 3) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in constants else types[n] for n in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", *HOPPER),
                              options={"num_warps": warps, "num_stages": stages})
    assert compiled.asm.get("cubin"), f"{kernel.fn.__name__}: no machine code"


def _ints(*names: str) -> dict[str, str]:
    return {n: "i32" for n in names}


PRODUCT = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16",
           **_ints("m", "n", "k", "k_part", "stride_x", "stride_w", "stride_y", "up_offset")}


@pytest.mark.parametrize("tiles", sorted({t for band in T.CANDIDATES for t in band}, key=str))
def test_every_candidate_tile_compiles_for_the_products_hopper_runs(tiles):
    for split, silu, out, bias in ((1, False, "*bf16", True), (8, True, "*bf16", False), (1, False, "*fp32", False)):
        _compile(T._product_kernel, dict(PRODUCT, y_ptr=out),
                 dict(HAS_BIAS=bias, IEEE=False, SILU_UP=silu, SPLIT=split, BM=tiles.rows, BN=tiles.cols,
                      BK=tiles.depth, GROUP=8), tiles.warps, tiles.stages)


def test_the_rotary_epilogue_and_the_other_kernels_compile_for_hopper():
    rope = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
            "pos_ptr": "*i64", "rows_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
            **_ints("m", "k", "k_part", "stride_x", "stride_w")}
    for tiles, bias in ((T.CANDIDATES[0][0], False), (T.NARROW, True)):
        _compile(T._qkv_rope_kernel, rope, dict(HAS_BIAS=bias, IEEE=False, SPLIT=4, HEADS=32, KV_HEADS=8, D=128,
                                                BM=tiles.rows, BH=max(tiles.cols, 128) // 2, BK=64, GROUP=8),
                 tiles.warps, tiles.stages)
    # The first kernels (Products.SPLIT), kept for comparison.
    _compile(T._linear_kernel, {**PRODUCT, "part_ptr": "*fp32"},
             dict(HAS_BIAS=False, IEEE=False, SPLIT=4, BM=64, BN=64, BK=64, GROUP=8))
    _compile(T._sum_parts_kernel, {"part_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16", **_ints("m", "n", "stride_y")},
             dict(HAS_BIAS=False, SPLIT=4, BLOCK=1024))
    _compile(T._silu_mul_kernel, {"gu_ptr": "*bf16", "y_ptr": "*bf16", "n": "i32"}, dict(BLOCK=1024))
