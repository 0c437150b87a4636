"""Where the embedded default pair lives, and which model a role resolves to when none is named.

The pair — SmolLM2-135M-Instruct and a drafter distilled from it — is fetched and installed by
`hybridspec models pull` (fetch/embedded.py); every process that loads a model looks here.
"""
from __future__ import annotations

import os
from pathlib import Path

TARGET_DIR = "smollm2-135m-instruct"
DRAFTER_DIRS = {"plain": "smollm2-135m-instruct-drafter",  # a 4-layer causal LM distilled from the target
                "eagle": "smollm2-135m-instruct-eagle"}  # an EAGLE head drafting from the target's features
DEFAULT_DRAFTER = "plain"  # what `edge generate` drafts with when no drafter is named (eagle does not beat it yet: docs/eagle.md)
COMPLETE_MARKER = ".hybridspec-complete"
EMBEDDED_PREFIX = "embedded:"  # `--drafter embedded:plain` names an embedded model by its role  # written last: a directory without it is not installed


def models_home() -> Path:
    """Where pulled checkpoints live: $HYBRIDSPEC_HOME/models, default ~/.cache/hybridspec/models."""
    home = os.environ.get("HYBRIDSPEC_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "hybridspec"
    return base / "models"


def default_paths() -> dict[str, Path]:
    """The checkpoints `cloud serve` and `edge generate` use when no model is named: the target, the
    default drafter, and each embedded drafter by kind ("plain" is also what an eagle head falls back on)."""
    home = models_home()
    drafters = {role: home / d for role, d in DRAFTER_DIRS.items()}
    return {"target": home / TARGET_DIR, "drafter": drafters[DEFAULT_DRAFTER], **drafters}


def resolve(model: str, role: str) -> str:
    """The model to load for `role` ("target", "drafter", "plain" or "eagle"): the given one, else the pulled default
    (or FileNotFoundError saying how to get it)."""
    if model.startswith(EMBEDDED_PREFIX):
        role, model = model[len(EMBEDDED_PREFIX):], ""
        if role not in default_paths():
            raise FileNotFoundError(f"no embedded model {role!r}; there are {', '.join(default_paths())}")
    if model:
        return model
    path = default_paths()[role]
    if not (path / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(f"the default {role} is not at {path}; run `hybridspec models pull` first")
    return str(path)
