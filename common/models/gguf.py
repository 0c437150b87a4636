"""A target served from its GGUF file by the llama.cpp engine: what the verifier must know about it
(name, tokenizer, end-of-sequence ids, a fingerprint of the weights) without loading it into torch.

A target option names a `.gguf` file, or a checkpoint directory holding one as `model.gguf` beside its
tokenizer (what `hybridspec models pull` installs). The tokenizer and the end-of-sequence ids come from
that directory's files, or, for a bare `.gguf`, from the file's own metadata (common/models/gguf_file.py):
the same vocabulary the torch path and an edge see, and no tensor is read to find it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .gguf_file import end_ids_of, file_identity, tokenizer_files
from .vocabulary import TokenizerFiles


GGUF_FILE = "model.gguf"  # a checkpoint directory's GGUF weights: a link to one of its model.<TYPE>.gguf
WEIGHT_TYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}  # llama_ftype of the types requantize() writes
# What a fresh `models pull` serves the embedded target in: Q8_0 written from the shipped Q4_1 (its
# values kept to 8-bit rounding) prefills faster than Q4_1 on llama.cpp's CPU kernels, decodes as
# fast and is as exact (docs/engine.md "Which weights", 92253c5:bench/weight_types.py).
DEFAULT_WEIGHTS = "Q8_0"


def typed_gguf(directory: Path, weights: str) -> Path:
    """Where a checkpoint directory keeps its GGUF weights of one type."""
    return directory / f"model.{weights}.gguf"


def served_weights(directory: Path) -> str:
    """The type of the weights a directory's model.gguf links to ("" when it is not such a link)."""
    link = directory / GGUF_FILE
    name = link.readlink().name if link.is_symlink() else ""
    return name.removeprefix("model.").removesuffix(".gguf") if name.startswith("model.") else ""


def select_weights(directory: Path, shipped: str, weights: str, log=print) -> None:
    """Make model.gguf the `weights` version of the directory's shipped GGUF (model.<shipped>.gguf),
    writing it with llama.cpp's quantiser if it is not there yet; other written versions are removed."""
    if weights not in WEIGHT_TYPES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_TYPES)}, got {weights!r}")
    wanted = typed_gguf(directory, weights)
    if not wanted.is_file():
        log(f"writing the target's weights as {weights} with llama.cpp (from the shipped {shipped})")
        partial = wanted.with_suffix(".partial")
        requantize(typed_gguf(directory, shipped), partial, weights)
        partial.rename(wanted)
    link = directory / GGUF_FILE
    staged = directory / (GGUF_FILE + ".new")
    staged.unlink(missing_ok=True)
    staged.symlink_to(wanted.name)
    staged.replace(link)  # atomic: a server starting meanwhile finds one version or the other
    for other in directory.glob("model.*.gguf"):
        if other not in (wanted, typed_gguf(directory, shipped)):
            other.unlink()


def llama_cpp_loads() -> bool:
    """True when llama-cpp-python imports and its library loads (it is compiled on install, which can
    fail): the one check both the cloud's engine choice and the edge's drafter engine make."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def find_gguf(spec: str | Path) -> Path | None:
    """The GGUF file a target option names (the file itself, or a directory's model.gguf), or None."""
    path = Path(str(spec)).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    inside = path / GGUF_FILE
    return inside if inside.is_file() else None


@dataclass(frozen=True)
class GgufTarget:
    """A GGUF target's identity; the weights themselves stay with llama.cpp."""

    name: str  # the target option as given
    path: Path  # the .gguf file
    vocab_size: int  # rows of the output head (the engine reads it from the file)

    @cached_property
    def tokenizer_dir(self) -> Path:
        """served_tokenizer_dir of the file."""
        return served_tokenizer_dir(self.path)

    @cached_property
    def tokenizer(self) -> TokenizerFiles:
        """`tokenizer_dir` read without transformers: the vocabulary and special tokens the verifier's
        fingerprint covers, and the end-of-sequence token."""
        return TokenizerFiles(self.tokenizer_dir)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation: the tokenizer's, and the directory's generation config or
        the GGUF's end-of-turn ids."""
        ids = {self.tokenizer.eos_token_id} - {None}
        ids.update(end_ids_of(self.tokenizer_dir))
        config = self.path.parent / "generation_config.json"
        if self.path.name == GGUF_FILE and config.is_file():
            eos = json.loads(config.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else eos or [])
        return tuple(sorted(ids))

    @cached_property
    def fingerprint(self) -> str:
        """The weights' identity (gguf_file.file_identity: sampled, cheap for a file of gigabytes)."""
        return file_identity(self.path)


def served_tokenizer_dir(gguf: Path) -> Path:
    """A served GGUF's tokenizer: the checkpoint directory when it holds the tokenizer beside model.gguf,
    else the files made from the GGUF's own metadata (gguf_file.tokenizer_files: no tensor is read),
    in a child process the first time, so that a replica never imports transformers."""
    if gguf.name == GGUF_FILE and (gguf.parent / "tokenizer_config.json").is_file():
        return gguf.parent
    return tokenizer_files(gguf, isolated=True)


def requantize(src: Path, dst: Path, weights: str, threads: int = 2) -> None:
    """Write `src`'s weights as type `weights` (a WEIGHT_TYPES key) to `dst` with llama.cpp's
    quantiser; from an already quantised file the values are dequantised first, so F16 and Q8_0 keep
    them (to their own rounding) while Q4_0 rounds them again."""
    import ctypes

    import llama_cpp as llama

    params = llama.llama_model_quantize_default_params()
    params.ftype = WEIGHT_TYPES[weights]
    params.allow_requantize = True
    params.nthread = threads
    # llama.cpp logs the file's metadata and every tensor (some 300 lines): a user pulling the models
    # should see our one progress line, and the log's tail only if the quantiser fails.
    log: list[str] = []
    _collect_llama_log(log)
    if llama.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        tail = "".join(log[-5:]).strip()
        raise RuntimeError(f"llama.cpp could not write {src} as {weights} to {dst}: {tail}")


_LOG_SINK: list[list[str]] = [[]]
_LOG_CALLBACK = None  # the ctypes callback, kept alive for as long as llama.cpp may call it


def _collect_llama_log(into: list[str]) -> None:
    """Send llama.cpp's log lines to `into` (the latest list given) instead of stderr."""
    global _LOG_CALLBACK
    import llama_cpp as llama

    _LOG_SINK[0] = into
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = llama.llama_log_callback(lambda level, text, data: _LOG_SINK[0].append(
            text.decode(errors="replace")))
    llama.llama_log_set(_LOG_CALLBACK, None)
