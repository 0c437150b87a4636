"""Which engine serves a target, and loading the two: the one place `engine: auto` is decided."""
from __future__ import annotations

import importlib.util

from ...common.config import ConfigError, DType
from ...common.models.gguf import GgufTarget, find_gguf
from ...common.models.loading import load_model, pick_device
from ..specs import EngineKind, VerifierLimits
from .base import Engine, Target


def llamacpp_installed() -> bool:
    """True when llama-cpp-python can be imported here."""
    return importlib.util.find_spec("llama_cpp") is not None


def pick_engine(target: str, engine: EngineKind, device: str, dtype: DType) -> EngineKind:
    """The engine `engine` resolves to for this target; ConfigError, in one line, for a combination that
    cannot run. Auto: llama.cpp on a CPU when the target has a GGUF file, no dtype was asked for and
    llama-cpp-python is installed; torch otherwise (GPUs, Hugging Face checkpoints, an explicit dtype)."""
    on_cpu = pick_device(device).type == "cpu"
    if engine is EngineKind.AUTO:
        usable = on_cpu and dtype is DType.AUTO and find_gguf(target) is not None and llamacpp_installed()
        return EngineKind.LLAMACPP if usable else EngineKind.TORCH
    if engine is EngineKind.LLAMACPP:
        if not on_cpu:
            raise ConfigError(f"the llamacpp engine runs on the CPU; device {device} needs engine torch")
        if dtype is not DType.AUTO:
            raise ConfigError(f"the llamacpp engine serves the GGUF file's own weight type; dtype {dtype} "
                             "needs engine torch")
        if find_gguf(target) is None:
            raise ConfigError(f"the llamacpp engine serves GGUF files: {target} is not a .gguf file and holds "
                             "no model.gguf")
        if not llamacpp_installed():
            raise ConfigError("the llamacpp engine needs llama-cpp-python (pip install -e .)")
    return engine


def _sequences(max_sessions: int) -> int:
    """llama.cpp sequence ids to hold: twice the live sessions, since a session being opened or
    re-opened holds its own until it goes live; at most llama.cpp's limit (LLAMA_MAX_SEQ, 256).
    A session that finds none free gets RESOURCE_EXHAUSTED like any full cache."""
    return min(2 * max_sessions, 256)


def load_engine(target: str, engine: EngineKind, device: str, dtype: DType, threads: int,
                limits: VerifierLimits) -> tuple[Target, Engine]:
    """The target's identity and the engine that serves it, loaded."""
    if pick_engine(target, engine, device, dtype) is EngineKind.LLAMACPP:
        from .llamacpp_engine import LlamaCppEngine

        gguf = find_gguf(target)
        served = LlamaCppEngine(gguf, limits.kv_cache_tokens, _sequences(limits.max_sessions), threads or 1)
        return GgufTarget(name=target, path=gguf, vocab_size=served.vocab_size), served
    import torch

    from .torch_engine import TorchEngine

    if threads:
        torch.set_num_threads(threads)
    loaded = load_model(target, device, dtype)
    return loaded, TorchEngine(loaded.model, limits.kv_cache_tokens)
