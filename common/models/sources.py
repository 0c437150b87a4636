"""What a model option names (a .gguf file, a compact drafter, a model directory, a cached hub id),
told from the files without loading anything: free of torch and transformers, so a command can refuse
a bad option in one line before anything heavy starts."""
from __future__ import annotations

from enum import Enum
from pathlib import Path

from .gguf_file import read_header
from .manifest import is_compact


class SourceKind(Enum):
    """What a model option names."""

    GGUF = "gguf"  # a .gguf file
    COMPACT = "compact"  # a compact drafter directory (common/models/compact.py)
    DIRECTORY = "directory"  # a Hugging Face checkpoint directory
    HUB_ID = "hub id"  # an id already in the local Hugging Face cache


def classify_model(spec: str | Path) -> SourceKind:
    """What `spec` names, checked without loading it; FileNotFoundError with a one-line reason when
    it is nothing that can be loaded offline. Fails fast in one process before others (Ray replicas)
    try to load it."""
    path = Path(str(spec)).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {spec} does not exist")
        read_header(path, strings=frozenset())  # ConfigError, in one line, for a file that is no GGUF
        return SourceKind.GGUF
    if is_compact(path):
        return SourceKind.COMPACT
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{spec} is not a model directory (no config.json)")
        return SourceKind.DIRECTORY
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(str(spec), "config.json")
    except ValueError:  # not even a well-formed hub id
        cached = None
    if not isinstance(cached, str):
        raise FileNotFoundError(
            f"cannot load model {str(spec)!r} offline: not a local directory, a .gguf file or a cached hub id")
    return SourceKind.HUB_ID
