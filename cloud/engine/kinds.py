"""The engines a replica can compute with, as a setting (light: configuration reads it before torch loads)."""
from __future__ import annotations

from ...common.config import Choice


class EngineKind(Choice):
    """What computes the target's forward passes in a replica (cloud/engine/)."""

    AUTO = "auto"  # llama.cpp on a CPU when the target has a GGUF file, else torch
    TORCH = "torch"  # Hugging Face weights in torch: the GPU path and the reference
    LLAMACPP = "llamacpp"  # the GGUF file in llama.cpp's CPU kernels


class Products(Choice):
    """Which matrix-product kernels the torch engine runs on CUDA (cloud/engine/triton_ops.py)."""

    SPLIT = "split"  # the first kernels: parts of K in fp32 buffers summed by a second kernel
    FUSED = "fused"  # parts summed in the program; tiles, or cuBLAS where proven exact, chosen at start-up
