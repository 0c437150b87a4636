"""The engines a replica can compute with, as a setting (light: configuration reads it before torch loads)."""
from __future__ import annotations

from ...common.config import Choice


class EngineKind(Choice):
    """What computes the target's forward passes in a replica (cloud/engine/)."""

    AUTO = "auto"  # llama.cpp on a CPU when the target has a GGUF file, else torch
    TORCH = "torch"  # Hugging Face weights in torch: the GPU path and the reference
    LLAMACPP = "llamacpp"  # the GGUF file in llama.cpp's CPU kernels
