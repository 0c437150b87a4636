"""Pass-cost curves kept on disk, so that a replica starting again on the same model, engine and
hardware reports its curve at once instead of timing it again (cloud/core/costs.py measures it).

A curve holds for what makes a pass cost what it does, and that is its key: the weights (the model's
fingerprint), the engine, its capabilities (device, weight type, the KV cache's layout) and the
settings the engine says shape a pass (`Engine.pass_settings`: threads, library version, batch sizes,
flash attention), the processor, and the measurement's own (sizes, context, repeats, batch sizes).
An engine that cannot say (the torch engine on CUDA, whose kernels are chosen per card at start-up)
is never cached: its curve is measured at every start.

One JSON file per key under $HYBRIDSPEC_HOME/pass-costs, named by a hash of the key and holding the
key itself and the curves. A file that cannot be read or parsed, holds another key, or holds no valid
curve is ignored with a log line, never an error: the replica measures again and the new curve
replaces it. Writing goes through a temporary file renamed into place, so a reader never sees half a
file; a cache that cannot be written is logged and the replica serves all the same.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import tempfile
from dataclasses import asdict
from pathlib import Path

from ..engine.base import Engine
from .costs import CONTEXT_TOKENS, REPEATS, cost_sizes

log = logging.getLogger(__name__)

FORMAT = 1  # of the files; a new format's files are other keys
Curves = tuple[tuple[tuple[int, float], ...], tuple[tuple[int, int, float], ...]]  # ModelInfo's two curves


def cache_dir() -> Path:
    """$HYBRIDSPEC_HOME/pass-costs, beside the pulled models."""
    from ...common.models.embedded import models_home

    return models_home().parent / "pass-costs"


def curve_key(model_fingerprint: str, engine: Engine, max_tokens: int,
              batch_sessions: tuple[int, ...] = ()) -> dict | None:
    """What the curves of `engine` serving the model `model_fingerprint`, measured up to `max_tokens`
    tokens (and at `batch_sessions` sessions), depend on; None when the engine cannot say."""
    settings = getattr(engine, "pass_settings", None)
    if settings is None or not model_fingerprint:
        return None
    return {"format": FORMAT, "model": model_fingerprint, "engine": type(engine).__name__,
            "capabilities": asdict(engine.capabilities), "capacity_tokens": engine.capacity_tokens,
            "settings": settings, "processor": processor(),
            "measurement": {"sizes": list(cost_sizes(max_tokens)), "context": CONTEXT_TOKENS, "repeats": REPEATS,
                            "batch_sessions": list(batch_sessions)}}


def processor() -> str:
    """The CPU's model name (/proc/cpuinfo), with the machine's architecture."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{name or platform.processor() or 'unknown'} ({platform.machine()})"


def load(key: dict, directory: Path | None = None) -> Curves | None:
    """The curves kept for `key`, or None (none kept, or a file that cannot be used: logged)."""
    path = _path(key, directory)
    if not path.is_file():
        return None
    try:
        kept = json.loads(path.read_text())
        if kept.get("key") != key:
            log.warning("ignoring the pass-cost cache %s: it was measured for another model, engine or machine", path)
            return None
        return _curves(kept["pass_costs"], kept["batch_pass_costs"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring the unreadable pass-cost cache %s (%s: %s); measuring again", path,
                    type(exc).__name__, exc)
        return None


def store(key: dict, curves: Curves, directory: Path | None = None) -> Path | None:
    """Keep `curves` for `key`; the file, or None where it cannot be written (logged)."""
    path = _path(key, directory)
    points, batches = curves
    body = json.dumps({"key": key, "pass_costs": [list(p) for p in points],
                       "batch_pass_costs": [list(b) for b in batches]}, indent=1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=".partial-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(staging, path)
    except OSError as exc:
        log.warning("could not keep the pass-cost curve in %s (%s); it is measured again at the next start",
                    path.parent, exc.strerror or exc)
        return None
    return path


def _path(key: dict, directory: Path | None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return (directory or cache_dir()) / f"{digest}.json"


def _curves(points, batches) -> Curves:
    """The kept curves, checked as the wire checks them (sizes increasing, times finite and positive);
    ValueError otherwise."""
    pass_costs = tuple((int(m), float(ms)) for m, ms in points)
    batch_costs = tuple((int(b), int(m), float(ms)) for b, m, ms in batches)
    sizes = [m for m, _ in pass_costs]
    times = [ms for _, ms in pass_costs] + [ms for _, _, ms in batch_costs]
    if not pass_costs or sizes != sorted(set(sizes)) or sizes[0] < 1 \
            or not all(math.isfinite(t) and t > 0 for t in times):
        raise ValueError("not a pass-cost curve")
    return pass_costs, batch_costs
