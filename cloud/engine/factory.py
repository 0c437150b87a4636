"""Which engine serves a target, and loading the two: the one place `engine: auto` is decided."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from importlib import metadata

from ...common.config import DEVICE_AUTO, ConfigError, DType
from ...common.models.gguf import GgufTarget, find_gguf, llama_cpp_loads, served_tokenizer_dir
from .base import Engine, KVLimits, Target
from .kinds import EngineKind


MAX_LLAMACPP_SESSIONS = 256  # llama.cpp's LLAMA_MAX_SEQ: sequences one context can hold


def pick_engine(target: str, engine: EngineKind, device: str, dtype: DType, max_sessions: int = 1) -> EngineKind:
    """The engine `engine` resolves to for this target; ConfigError, in one line, for a combination that
    cannot run. Auto: llama.cpp on a CPU when the target has a GGUF file, no dtype was asked for,
    llama-cpp-python is installed and max_sessions is within llama.cpp's limit; torch otherwise (GPUs,
    Hugging Face checkpoints, an explicit dtype)."""
    on_cpu = _on_cpu(device)
    if engine is EngineKind.AUTO:
        usable = on_cpu and dtype is DType.AUTO and find_gguf(target) is not None and llama_cpp_loads()
        engine = EngineKind.LLAMACPP if usable and max_sessions <= MAX_LLAMACPP_SESSIONS else EngineKind.TORCH
    elif engine is EngineKind.LLAMACPP:
        if not on_cpu:
            raise ConfigError(f"the llamacpp engine runs on the CPU; device {device} needs engine torch")
        if dtype is not DType.AUTO:
            raise ConfigError(f"the llamacpp engine serves the GGUF file's own weight type; dtype {dtype} "
                             "needs engine torch")
        if find_gguf(target) is None:
            raise ConfigError(f"the llamacpp engine serves GGUF files: {target} is not a .gguf file and holds "
                             "no model.gguf")
        if not llama_cpp_loads():
            raise ConfigError("the llamacpp engine needs llama-cpp-python (pip install -e .)")
    if engine is EngineKind.LLAMACPP and max_sessions > MAX_LLAMACPP_SESSIONS:
        raise ConfigError(f"the llamacpp engine holds at most {MAX_LLAMACPP_SESSIONS} sessions per replica; "
                          f"max_sessions is {max_sessions}")
    return engine


def load_engine(target: str, engine: EngineKind, device: str, dtype: DType, threads: int,
                limits: KVLimits) -> tuple[Target, Engine]:
    """The target's identity and the engine that serves it, loaded."""
    if pick_engine(target, engine, device, dtype, limits.max_sessions) is EngineKind.LLAMACPP:
        gguf = find_gguf(target)
        # The tokenizer first (made from the header the first time a file is served, in a child
        # process): that child's memory then never adds to the loaded model's.
        served_tokenizer_dir(gguf)
        from .llamacpp_engine import LlamaCppEngine

        served = LlamaCppEngine.serving(gguf, limits, threads or 1)
        return GgufTarget(name=target, path=gguf, vocab_size=served.vocab_size), served
    import torch

    from ...common.models.loading import load_model
    from .torch_engine import engine_for

    if threads:
        torch.set_num_threads(threads)
    loaded = load_model(target, device, dtype)
    served = ServedTarget(loaded.name, loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids, loaded.fingerprint)
    # The engine keeps its own (fused) copies of what it multiplies; the Hugging Face model is dropped.
    return served, engine_for(loaded.model, limits.kv_cache_tokens, limits.max_context)


def _on_cpu(device: str) -> bool:
    """Whether `device` resolves to the CPU (common/models/loading.py pick_device), answered without
    importing torch where no answer needs it: "cpu", or "auto" beside a torch built for CPUs only
    (its version ends in +cpu). A Ray pool's front door, which loads no model, then never imports torch."""
    if device == "cpu":
        return True
    if device == DEVICE_AUTO:
        try:
            if metadata.version("torch").endswith("+cpu"):
                return True
        except metadata.PackageNotFoundError:
            pass
    from ...common.models.loading import pick_device

    return pick_device(device).type == "cpu"


@dataclass(frozen=True)
class ServedTarget:
    """What the core reports about a target served from its weights (engine.base.Target)."""

    name: str
    tokenizer: Any
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    fingerprint: str
