"""Compact drafter checkpoints: the drafter's own weights plus a reference to the target's.

A drafter distilled from a target shares the target's token embeddings and output head, so it
stores only what it owns: its decoder layers, its final norm (fp16), and `head_ids`, the rows of
the target's head it predicts over (a frequency-ranked subset of the vocabulary; a smaller head is
what makes a 2-layer drafter cheap, since a 49k-row head alone costs as much as 8 layers).
A directory holding `hybridspec-drafter.json` is such a checkpoint; `load_model` recognises it.
Matrices are stored in fp16, or in int8 with a per-row fp16 scale (half the bytes, for shipping).
This module reads them (edge and tools load drafters); writing them is distill/student.py's job.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .eagle import EagleHead
from .manifest import EAGLE_KIND, MANIFEST, WEIGHTS, Manifest, resolve_base

SCALE_SUFFIX = ".int8_scale"


def dequantize(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stored tensors back to floating point (int8 matrices times their per-row scales)."""
    out = {}
    for name, value in stored.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = stored.get(name + SCALE_SUFFIX)
        out[name] = value if scale is None else value.float() * scale.float()[:, None]
    return out


def load_compact(path: Path, dtype: torch.dtype, full_head: bool = False):
    """(model, tokenizer, head_ids) for a compact drafter (an EagleHead for an eagle head); the target's shared tensors are read
    straight from its safetensors files, without loading the whole target.

    full_head: give the model the target's whole output head instead of its slice (head_ids then
    covers the vocabulary), for code that needs a drop-in full-vocabulary model, such as Hugging
    Face assisted generation. It predicts the same over the slice, and may pick tokens outside it.
    """
    manifest = Manifest(**json.loads((path / MANIFEST).read_text()))
    base = resolve_base(path, manifest)
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"drafter {path} refers to target {base}, which is not there "
                                "(run `hybridspec models pull` for the embedded one)")
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    config = AutoConfig.from_pretrained(base, local_files_only=True)
    tied = getattr(config, "tie_word_embeddings", False)
    if manifest.kind == EAGLE_KIND:
        head = _load_eagle(path, manifest, base, config, tied, dtype)
        return head, tokenizer, head.head_ids
    config.num_hidden_layers = manifest.num_layers
    config.tie_word_embeddings = False
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[: manifest.num_layers]
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with safe_open(path / WEIGHTS, framework="pt") as f:
        own = {k: f.get_tensor(k) for k in f.keys()}
    head_ids = own.pop("head_ids").long()
    own = dequantize(own)
    embed = _read_base_tensor(base, "model.embed_tokens.weight")
    head = embed if tied else _read_base_tensor(base, "lm_head.weight")
    state = {**{k: v.to(dtype) for k, v in own.items()}, "model.embed_tokens.weight": embed.to(dtype)}
    missing = set(model.load_state_dict(state, strict=False).missing_keys) - {"lm_head.weight"}
    if missing:
        raise FileNotFoundError(f"drafter {path} lacks weights: {', '.join(sorted(missing)[:3])}")
    if full_head:
        head_ids = torch.arange(head.shape[0])
    model.lm_head = nn.Linear(head.shape[1], head_ids.numel(), bias=False, dtype=dtype)
    model.lm_head.weight = nn.Parameter(head[head_ids].to(dtype), requires_grad=False)
    return model, tokenizer, head_ids


def _load_eagle(path: Path, manifest: Manifest, base: Path, config, tied: bool, dtype: torch.dtype) -> EagleHead:
    with safe_open(path / WEIGHTS, framework="pt") as f:
        own = {k: f.get_tensor(k) for k in f.keys()}
    head_ids = own.pop("head_ids").long()
    embed = _read_base_tensor(base, "model.embed_tokens.weight").to(dtype)
    head = embed if tied else _read_base_tensor(base, "lm_head.weight").to(dtype)
    model = EagleHead(config, embed, head[head_ids].clone(), head_ids, manifest.num_layers).to(dtype)
    missing = model.load_state_dict({k: v.to(dtype) for k, v in dequantize(own).items()}, strict=False).missing_keys
    if missing:
        raise FileNotFoundError(f"eagle head {path} lacks weights: {', '.join(sorted(missing)[:3])}")
    return model


def _read_base_tensor(base: Path, name: str) -> torch.Tensor:
    for file in sorted(base.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise FileNotFoundError(f"target {base} has no tensor {name}")

