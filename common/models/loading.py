"""Loading causal LMs for either role: a local HF checkpoint, a cached hub id, or a GGUF file.

Nothing here reaches the network: every load passes local_files_only, and the CLI sets the Hugging
Face offline switches before transformers is imported.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from . import compact
from ..config import DEVICE_AUTO, DType
from ..protocol.fingerprints import fingerprint
from .checkpoint import ensure_checkpoint
from .drafter_gguf import DrafterEngine, LlamaDraftFiles, pick_engine
from .manifest import is_compact


@dataclass
class LoadedModel:
    """A model in eval mode on its device, with its tokenizer and identity."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    head_ids: torch.Tensor | None = None  # compact drafters: the vocabulary ids of the head's rows
    # A compact drafter that drafts on llama.cpp (its converted GGUF; edge/llamacpp_lm.py); None: torch.
    llama: LlamaDraftFiles | None = None

    @property
    def is_eagle(self) -> bool:
        """True for an EAGLE feature head (it drafts only with the target's features)."""
        return getattr(self.model, "is_eagle_head", False)

    @property
    def vocab_size(self) -> int:
        """Ids the model can see: rows of the input embedding (the head may be a subset or padded)."""
        return int(self.model.get_input_embeddings().weight.shape[0])

    @property
    def fingerprint(self) -> str:
        """The weights' identity (model_fingerprint)."""
        return model_fingerprint(self.model)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation, from the generation config and the tokenizer."""
        ids: set[int] = set()
        for source in (getattr(self.model.generation_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if source is None:
                continue
            ids.update([source] if isinstance(source, int) else source)
        return tuple(sorted(ids))


def pick_device(requested: str = DEVICE_AUTO) -> torch.device:
    """'auto' picks CUDA when present, else CPU; anything else is passed to torch.device."""
    if requested == DEVICE_AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def pick_dtype(device: torch.device, requested: str = "auto") -> torch.dtype:
    """'auto' is bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU."""
    if requested != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[requested]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


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


def load_model(spec: str | Path, device: str = DEVICE_AUTO, dtype: str = DType.AUTO,
               engine: str = DrafterEngine.AUTO, threads: int = 0) -> LoadedModel:
    """Load a causal LM and its tokenizer from a directory, a .gguf file or a cached hub id.

    engine: what a compact drafter drafts with (drafter_gguf.DrafterEngine; auto = llama.cpp on a CPU
    when it has a converted GGUF), recorded as `llama`; the torch model is loaded either way (its
    tokenizer, identity and end-of-sequence ids, and the reference). threads: llama.cpp's, 0 = 1.
    Raises FileNotFoundError with a one-line reason when nothing loadable is found.
    """
    spec = str(spec)
    kind = classify_model(spec)
    dev = pick_device(device)
    kwargs: dict = {"dtype": pick_dtype(dev, dtype), "local_files_only": True}
    path = Path(spec).expanduser()
    if kind is SourceKind.COMPACT:
        model, tokenizer, head_ids = compact.load_compact(path, kwargs["dtype"])
        llama = pick_engine(engine, path, dev.type, dtype, threads or 1)
        model.to(dev).eval()
        return LoadedModel(name=spec, model=model, tokenizer=tokenizer, device=dev,
                           head_ids=None if head_ids is None else head_ids.to(dev), llama=llama)
    if kind is SourceKind.DIRECTORY:
        ensure_checkpoint(path)  # a pulled target keeps only its GGUF until torch needs the weights
    source, tok_kwargs = {SourceKind.GGUF: (str(path.parent), {"gguf_file": path.name}),
                          SourceKind.DIRECTORY: (str(path), {}), SourceKind.HUB_ID: (spec, {})}[kind]
    kwargs.update(tok_kwargs)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, **tok_kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as exc:
        raise FileNotFoundError(f"cannot load model {spec!r} offline: its files are incomplete or unreadable") from exc
    model.to(dev).eval()
    return LoadedModel(name=spec, model=model, tokenizer=tokenizer, device=dev)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 over the vocabulary and the special tokens: equal iff both sides tokenize alike."""
    return fingerprint(tokenizer.get_vocab(), tokenizer.all_special_tokens)


def model_fingerprint(model: PreTrainedModel) -> str:
    """sha256 over the architecture and a sample of every weight, independent of the load dtype.

    Weights are rounded to bfloat16 before hashing so an fp32 CPU replica and a bf16 GPU replica
    of the same checkpoint agree.
    """
    h = hashlib.sha256(f"{model.config.model_type}:{model.num_parameters()}".encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 64)][:64].to("cpu", torch.bfloat16).float()
        h.update(name.encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:32]


def truncate_cache(cache, length: int) -> None:
    """Drop cached positions beyond `length` (transformers 5.x `crop` takes minus the count to remove)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
