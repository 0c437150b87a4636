"""A compact drafter directory's manifest (common/models/compact.py): what it declares and where its target
lies. Free of torch, so the edge can find the tokenizer before loading any model."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import Choice

MANIFEST = "hybridspec-drafter.json"
WEIGHTS = "drafter.safetensors"
EMBEDDED_TARGET = "embedded:target"  # base reference resolved to the pulled default target
EAGLE_KIND = "eagle"  # Manifest.kind of an eagle head checkpoint (common/models/eagle.py)


class Store(Choice):
    """How a compact checkpoint stores its matrices."""

    FLOAT16 = "float16"
    INT8 = "int8"  # one fp16 scale per row: half the bytes


@dataclass(frozen=True)
class Manifest:
    """What a compact drafter directory declares about itself."""

    base: str  # the target: absolute path, path relative to this directory, or "embedded:target"
    num_layers: int  # decoder layers the drafter owns
    base_tokenizer_fingerprint: str  # the drafter only makes sense with this tokenizer
    format: int = 1
    store: str = "float16"  # how matrices are stored: float16, or int8 with one fp16 scale per row
    kind: str = "model"  # model: a small causal LM; eagle: an EAGLE feature head (common/models/eagle.py)


def is_compact(path: Path) -> bool:
    """True when `path` is a compact drafter directory."""
    return (path / MANIFEST).is_file()


def resolve_base(path: Path, manifest: Manifest) -> Path:
    """The target directory a compact drafter refers to."""
    if manifest.base == EMBEDDED_TARGET:
        from .embedded import default_paths

        return default_paths()["target"]
    base = Path(manifest.base).expanduser()
    return base if base.is_absolute() else (path / base).resolve()
