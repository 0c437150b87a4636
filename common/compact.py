"""Compact drafter checkpoints: the drafter's own weights plus a reference to the target's.

A drafter distilled from a target shares the target's token embeddings and output head, so it
stores only what it owns: its decoder layers, its final norm (fp16), and `head_ids`, the rows of
the target's head it predicts over (a frequency-ranked subset of the vocabulary; a smaller head is
what makes a 2-layer drafter cheap, since a 49k-row head alone costs as much as 8 layers).
A directory holding `hybridspec-drafter.json` is such a checkpoint; `load_model` recognises it.
Matrices are stored in fp16, or in int8 with a per-row fp16 scale (half the bytes, for shipping).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

MANIFEST = "hybridspec-drafter.json"
WEIGHTS = "drafter.safetensors"
EMBEDDED_TARGET = "embedded:target"  # base reference resolved to the pulled default target


@dataclass(frozen=True)
class Manifest:
    """What a compact drafter directory declares about itself."""

    base: str  # the target: absolute path, path relative to this directory, or "embedded:target"
    num_layers: int  # decoder layers the drafter owns
    base_tokenizer_fingerprint: str  # the drafter only makes sense with this tokenizer
    format: int = 1
    store: str = "float16"  # how matrices are stored: float16, or int8 with one fp16 scale per row


def is_compact(path: Path) -> bool:
    """True when `path` is a compact drafter directory."""
    return (path / MANIFEST).is_file()


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


STORES = ("float16", "int8")
SCALE_SUFFIX = ".int8_scale"


def save_compact(student: PreTrainedModel, head_ids: torch.Tensor, out: Path, manifest: Manifest) -> None:
    """Write the drafter's own weights (as `manifest.store` says) plus the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = stored_tensors(student, manifest.store)
    tensors["head_ids"] = head_ids.to("cpu", torch.int32).contiguous()
    save_file(tensors, out / WEIGHTS)
    (out / MANIFEST).write_text(json.dumps(asdict(manifest), indent=2) + "\n")


def stored_tensors(student: PreTrainedModel, store: str) -> dict[str, torch.Tensor]:
    """The drafter's own weights as a checkpoint stores them (fp16, or int8 matrices plus scales)."""
    if store not in STORES:
        raise ValueError(f"store must be one of {', '.join(STORES)}, got {store!r}")
    tensors: dict[str, torch.Tensor] = {}
    for name, value in own_state(student).items():
        half = value.detach().to("cpu", torch.float16).contiguous()
        if store == "int8" and half.dim() == 2:
            tensors[name], tensors[name + SCALE_SUFFIX] = quantize_int8(half)
        else:
            tensors[name] = half
    return tensors


def round_to_storage(student: PreTrainedModel, store: str) -> None:
    """Replace the student's own weights by what a checkpoint would restore, to evaluate exactly that."""
    restored = _dequantize(stored_tensors(student, store))
    student.load_state_dict({k: v.to(student.dtype) for k, v in restored.items()}, strict=False)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of an fp16 matrix [R, C]: (int8 [R, C], fp16 scale [R]).

    Quantising the fp16 values (not fp32 master weights) makes an fp16 checkpoint convertible to
    exactly the int8 one training would have written.
    """
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8).to(torch.float16)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def _dequantize(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in stored.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = stored.get(name + SCALE_SUFFIX)
        out[name] = value if scale is None else value.float() * scale.float()[:, None]
    return out


def resolve_base(path: Path, manifest: Manifest) -> Path:
    """The target directory a compact drafter refers to."""
    if manifest.base == EMBEDDED_TARGET:
        from .embedded import default_paths

        return default_paths()["target"]
    base = Path(manifest.base).expanduser()
    return base if base.is_absolute() else (path / base).resolve()


def load_compact(path: Path, dtype: torch.dtype, full_head: bool = False):
    """(model, tokenizer, head_ids) for a compact drafter; the target's shared tensors are read
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
    config.num_hidden_layers = manifest.num_layers
    config.tie_word_embeddings = False
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[: manifest.num_layers]
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with safe_open(path / WEIGHTS, framework="pt") as f:
        own = {k: f.get_tensor(k) for k in f.keys()}
    head_ids = own.pop("head_ids").long()
    own = _dequantize(own)
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


def _read_base_tensor(base: Path, name: str) -> torch.Tensor:
    for file in sorted(base.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise FileNotFoundError(f"target {base} has no tensor {name}")

