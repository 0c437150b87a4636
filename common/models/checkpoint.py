"""A target directory whose torch checkpoint is written from its GGUF only when something needs it.

`models pull` keeps the shipped GGUF, the config and the tokenizer, and the two tensors a compact
drafter reads from its target (`SHARED_TENSORS`): everything the llama.cpp engine and the edge need.
The fp32 checkpoint (538 MB for the embedded target) serves the torch engine and distillation only,
so the pull leaves a note naming the GGUF to dequantise instead (`write_deferred`), and the first
load of the directory through torch writes it (`ensure_checkpoint`), once, under a file lock: Ray
replicas and test processes may start together.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

SOURCE_NOTE = "checkpoint-from-gguf.json"  # {"gguf": file name}: the checkpoint, when needed, comes from it
CHECKPOINT_FILES = ("model.safetensors", "model.safetensors.index.json")  # what transformers loads weights from
# The tensors a compact drafter shares with its target (common/models/compact.py reads them by these
# names), kept in fp32 beside a deferred checkpoint: 113 MB for the embedded target instead of 538.
SHARED_TENSORS = "shared-tensors.safetensors"
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}


def write_deferred(gguf: Path, out: Path, gguf_name: str) -> None:
    """Into `out`: `gguf`'s config, generation config and tokenizer, the tensors compact drafters read
    (the embeddings, and the head unless tied), and the note that the checkpoint, when something needs
    it, is the dequantisation of `out / gguf_name` (the caller puts the GGUF there)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    src, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(src, gguf_file=name, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # What saving the dequantised model would record: its class, and the fp32 the checkpoint will hold.
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = "float32"
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(src, gguf_file=name, local_files_only=True).save_pretrained(out)
    tensors = {t.name: t for t in GGUFReader(gguf).tensors}
    shared = {}
    for hf_name, gguf_tensor in GGUF_NAMES.items():
        if gguf_tensor in tensors:  # no output.weight: the head is tied to the embeddings
            t = tensors[gguf_tensor]
            shared[hf_name] = dequantize(t.data, t.tensor_type).astype("float32")
    save_file(shared, str(out / SHARED_TENSORS))
    (out / SOURCE_NOTE).write_text(json.dumps({"gguf": gguf_name}) + "\n")


def deferred(directory: Path) -> Path | None:
    """The GGUF whose dequantisation is `directory`'s checkpoint, while the checkpoint is not written."""
    note = directory / SOURCE_NOTE
    if not note.is_file() or any((directory / f).exists() for f in CHECKPOINT_FILES):
        return None
    return directory / json.loads(note.read_text())["gguf"]


def ensure_checkpoint(directory: Path, log: Callable[[str], None] | None = None) -> None:
    """Write the directory's fp32 safetensors from its GGUF if they are deferred (a no-op otherwise)."""
    if deferred(directory) is None:
        return
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    with _locked(directory):
        gguf = deferred(directory)
        if gguf is None:  # another process wrote it while this one waited
            return
        from .gguf_file import read_header

        size = read_header(gguf, strings=frozenset()).parameters * 4  # float32
        log(f"writing the torch checkpoint of {directory.name} from {gguf.name}, once: {size / 1e6:,.0f} MB on disk "
            "(the torch engine and distillation read it; llama.cpp serves the GGUF as it is)")
        staging = directory / ".checkpoint.partial"
        shutil.rmtree(staging, ignore_errors=True)
        dequantise(gguf, staging)
        for f in CHECKPOINT_FILES:  # only the weights: the config and tokenizer are there already
            if (staging / f).exists():
                (staging / f).rename(directory / f)
        for shard in staging.glob("model-*.safetensors"):
            shard.rename(directory / shard.name)
        shutil.rmtree(staging, ignore_errors=True)


def dequantise(gguf: Path, out: Path) -> None:
    """GGUF -> fp32 safetensors (and config) in `out`. transformers will not save a GGUF-loaded model
    directly, so a fresh model is built from the config and the dequantised state dict loaded into it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src, name = str(gguf.parent), gguf.name
    with progress_shown():
        loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32, local_files_only=True)
    config = AutoConfig.from_pretrained(src, gguf_file=name, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(out)


@contextlib.contextmanager
def progress_shown() -> Iterator[None]:
    """transformers' progress bars on (the CLI turns them off), for the one long step they show: the
    GGUF's tensors de-quantised one by one."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        yield
    finally:
        if not shown:
            hf_logging.disable_progress_bar()


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    with open(directory / ".checkpoint.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
