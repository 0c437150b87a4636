"""Loading causal LMs for either role: a local HF checkpoint, a cached hub id, or a GGUF file.

A GGUF file that llama.cpp runs (a drafter on the edge's CPU) is not loaded into torch at all: its
tokenizer, end-of-sequence ids and size come from its header (common/models/gguf_file.py) and
llama.cpp maps the weights when it drafts. Only the torch engine reads a GGUF's tensors, de-quantised
to float32 in memory (saying so, with the memory it takes, before it starts).

Nothing here reaches the network: every load passes local_files_only, and the CLI sets the Hugging
Face offline switches before transformers is imported. transformers is imported only when a model
or a tokenizer is loaded through it: a replica serving a GGUF on llama.cpp never needs it.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import DEVICE_AUTO, DType
from ..protocol.fingerprints import fingerprint
from .checkpoint import ensure_checkpoint, progress_shown
from .drafter_gguf import DrafterEngine, LlamaDraftFiles, gguf_drafter_files, pick_engine
from .gguf_file import GgufHeader, file_identity, read_header, tokenizer_files
from .sources import SourceKind, classify_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class LoadedModel:
    """A model in eval mode on its device, with its tokenizer and identity."""

    name: str
    model: PreTrainedModel | None  # None: a GGUF model llama.cpp runs from its file (`gguf`, `llama`)
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    head_ids: torch.Tensor | None = None  # compact drafters: the vocabulary ids of the head's rows
    # What drafts on llama.cpp (edge/llamacpp_lm.py): a compact drafter's converted GGUF, or a GGUF
    # model of its own; None: torch.
    llama: LlamaDraftFiles | None = None
    gguf: GgufHeader | None = None  # a GGUF model llama.cpp runs: its header (model is None)

    @property
    def is_eagle(self) -> bool:
        """True for an EAGLE feature head (it drafts only with the target's features)."""
        return getattr(self.model, "is_eagle_head", False)

    @property
    def vocab_size(self) -> int:
        """Ids the model can see: rows of the input embedding (the head may be a subset or padded)."""
        if self.model is None:
            return self.gguf.vocab_size
        return int(self.model.get_input_embeddings().weight.shape[0])

    @property
    def fingerprint(self) -> str:
        """The weights' identity (model_fingerprint; a GGUF run by llama.cpp: its file's identity)."""
        return file_identity(self.gguf.path) if self.model is None else model_fingerprint(self.model)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation, from the generation config (a GGUF's end-of-turn ids) and
        the tokenizer."""
        ids: set[int] = set()
        config = getattr(self.model, "generation_config", None)
        sources = [getattr(config, "eos_token_id", None), self.tokenizer.eos_token_id]
        if self.gguf is not None:
            sources.append(list(self.gguf.end_ids))
        for source in sources:
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


def load_drafter(spec: str | Path, device: str = DEVICE_AUTO, dtype: str = DType.AUTO,
                 engine: str = DrafterEngine.AUTO, threads: int = 0) -> LoadedModel:
    """A drafter as the edge drafts with it. A GGUF file whose `engine` resolves to llama.cpp (auto: on
    a CPU with no dtype asked for) is not loaded into torch: `model` is None, llama.cpp maps the file
    when it drafts (`llama`), and the tokenizer, end ids and size come from its header. Anything else
    is `load_model`'s. threads: llama.cpp's, 0 = 1."""
    from transformers import AutoTokenizer

    path = Path(str(spec)).expanduser()
    if classify_model(spec) is SourceKind.GGUF:
        llama = gguf_drafter_files(path, engine, pick_device(device).type, dtype, threads or 1)
        if llama is not None:
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_files(path)), local_files_only=True)
            return LoadedModel(name=str(spec), model=None, tokenizer=tokenizer, device=torch.device("cpu"),
                               llama=llama, gguf=read_header(path, strings=frozenset()))
    return load_model(spec, device, dtype, engine, threads)


def load_model(spec: str | Path, device: str = DEVICE_AUTO, dtype: str = DType.AUTO,
               engine: str = DrafterEngine.AUTO, threads: int = 0) -> LoadedModel:
    """Load a causal LM and its tokenizer from a directory, a .gguf file or a cached hub id, into torch.

    engine: what a compact drafter drafts with (drafter_gguf.DrafterEngine; auto = llama.cpp on a CPU
    when it has a converted GGUF), recorded as `llama`; its torch model is loaded either way (its
    tokenizer, identity and end-of-sequence ids, and the reference). A GGUF file's tensors are
    de-quantised into torch (`load_drafter` runs a GGUF drafter on llama.cpp instead). threads:
    llama.cpp's, 0 = 1. Raises FileNotFoundError with a one-line reason when nothing loadable is found.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = str(spec)
    kind = classify_model(spec)
    dev = pick_device(device)
    kwargs: dict = {"dtype": pick_dtype(dev, dtype), "local_files_only": True}
    path = Path(spec).expanduser()
    if kind is SourceKind.COMPACT:
        from . import compact

        model, tokenizer, head_ids = compact.load_compact(path, kwargs["dtype"])
        llama = pick_engine(engine, path, dev.type, dtype, threads or 1)
        model.to(dev).eval()
        return LoadedModel(name=spec, model=model, tokenizer=tokenizer, device=dev,
                           head_ids=None if head_ids is None else head_ids.to(dev), llama=llama)
    if kind is SourceKind.GGUF:
        _say_dequantising(path)
    if kind is SourceKind.DIRECTORY:
        ensure_checkpoint(path)  # a pulled target keeps only its GGUF until torch needs the weights
    source, tok_kwargs = {SourceKind.GGUF: (str(path.parent), {"gguf_file": path.name}),
                          SourceKind.DIRECTORY: (str(path), {}), SourceKind.HUB_ID: (spec, {})}[kind]
    kwargs.update(tok_kwargs)
    try:
        if kind is SourceKind.GGUF:  # its tokenizer from its metadata, as every other GGUF user reads it
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_files(path)), local_files_only=True)
            with progress_shown():
                model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        else:
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, **tok_kwargs)
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as exc:
        raise FileNotFoundError(f"cannot load model {spec!r} offline: its files are incomplete or unreadable") from exc
    model.to(dev).eval()
    return LoadedModel(name=spec, model=model, tokenizer=tokenizer, device=dev,
                       gguf=read_header(path, strings=frozenset()) if kind is SourceKind.GGUF else None)


def _say_dequantising(path: Path) -> None:
    """Before torch reads a GGUF: what it will cost (every tensor de-quantised to float32 in memory)."""
    header = read_header(path, strings=frozenset())
    print(f"loading {path.name} into torch: de-quantising its {len(header.tensors)} tensors to float32, "
          f"{header.parameters * 4 / 2**20:,.0f} MiB of memory (llama.cpp runs the file as it is: engine "
          "llamacpp, on a CPU)", file=sys.stderr, flush=True)


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
