"""Where the embedded default pair lives, and which model a role resolves to when none is named.

The pair — SmolLM2-135M-Instruct and a drafter distilled from it — is fetched and installed by
`hybridspec models pull` (fetch/embedded.py); every process that loads a model looks here.
"""
from __future__ import annotations

import os
from pathlib import Path

TARGET_DIR = "smollm2-135m-instruct"
DRAFTER_DIR = "smollm2-135m-instruct-drafter"
COMPLETE_MARKER = ".hybridspec-complete"  # written last: a directory without it is not installed


def models_home() -> Path:
    """Where pulled checkpoints live: $HYBRIDSPEC_HOME/models, default ~/.cache/hybridspec/models."""
    home = os.environ.get("HYBRIDSPEC_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "hybridspec"
    return base / "models"


def default_paths() -> dict[str, Path]:
    """The checkpoints `cloud serve` and `edge generate` use when no model is named."""
    home = models_home()
    return {"target": home / TARGET_DIR, "drafter": home / DRAFTER_DIR}


def resolve(model: str, role: str) -> str:
    """The model to load for `role` ("target" or "drafter"): the given one, else the pulled default
    (or FileNotFoundError saying how to get it)."""
    if model:
        return model
    path = default_paths()[role]
    if not (path / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(f"the default {role} is not at {path}; run `hybridspec models pull` first")
    return str(path)
