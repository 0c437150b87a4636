"""Building and writing compact drafters (the reading side is common/models/compact.py): a student
initialised from the target, the weights it owns, and their storage in fp16 or int8."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from ..common.config import choice
from ..common.models.compact import MANIFEST, SCALE_SUFFIX, WEIGHTS, Manifest, dequantize
from ..common.models.manifest import Store



def build_student(target: PreTrainedModel, num_layers: int, head_ids: torch.Tensor | None,
                  dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A drafter initialised from the target: its first `num_layers` layers, final norm, frozen copies of
    its embeddings and of the head rows `head_ids` (all rows when None), in `dtype` on the target's device.

    fp32 by default: the student trains with fp32 master weights even when the target runs in bf16.
    """
    config = AutoConfig.for_model(**{**target.config.to_dict(), "num_hidden_layers": num_layers,
                                     "tie_word_embeddings": False})
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    device = target.device
    student = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    student.model.embed_tokens = nn.Embedding.from_pretrained(
        target.get_input_embeddings().weight.detach().to(dtype), freeze=True)
    for mine, theirs in zip(student.model.layers, target.model.layers):
        mine.load_state_dict(theirs.state_dict())
    student.model.norm.load_state_dict(target.model.norm.state_dict())
    head = target.get_output_embeddings().weight
    rows = head if head_ids is None else head[head_ids.to(head.device)]
    student.lm_head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=device, dtype=dtype)
    student.lm_head.weight = nn.Parameter(rows.detach().to(dtype).clone(), requires_grad=False)
    return student


def own_state(student: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The weights a compact checkpoint stores: decoder layers and final norm."""
    return {k: v for k, v in student.state_dict().items() if k.startswith(("model.layers.", "model.norm."))}


def save_compact(state: dict[str, torch.Tensor], head_ids: torch.Tensor, out: Path, manifest: Manifest) -> None:
    """Write a drafter's own weights `state` (as `manifest.store` says), its head rows and the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = stored_tensors(state, manifest.store)
    tensors["head_ids"] = head_ids.to("cpu", torch.int32).contiguous()
    save_file(tensors, out / WEIGHTS)
    (out / MANIFEST).write_text(json.dumps(asdict(manifest), indent=2) + "\n")


def stored_tensors(state: dict[str, torch.Tensor], store: str) -> dict[str, torch.Tensor]:
    """A drafter's own weights as a checkpoint stores them (fp16, or int8 matrices plus scales)."""
    store = choice(Store, store, "store")
    tensors: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        half = value.detach().to("cpu", torch.float16).contiguous()
        if store == "int8" and half.dim() == 2:
            tensors[name], tensors[name + SCALE_SUFFIX] = quantize_int8(half)
        else:
            tensors[name] = half
    return tensors


def round_to_storage(student: nn.Module, store: str, state: dict[str, torch.Tensor] | None = None) -> None:
    """Replace the student's own weights (`state`; default: those of a causal-LM student) by what a
    checkpoint would restore, to evaluate exactly that."""
    restored = dequantize(stored_tensors(own_state(student) if state is None else state, store))
    dtype = next(student.parameters()).dtype
    student.load_state_dict({k: v.to(dtype) for k, v in restored.items()}, strict=False)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of an fp16 matrix [R, C]: (int8 [R, C], fp16 scale [R]).

    Quantising the fp16 values (not fp32 master weights) makes an fp16 checkpoint convertible to
    exactly the int8 one training would have written.
    """
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8).to(torch.float16)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()
