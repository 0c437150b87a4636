"""What a GGUF file says about itself, read from its header alone: its metadata, its tensor table and
the tokenizer it describes; never a tensor's data. Reading a header costs milliseconds and no memory
beyond it, however large the weights (llama.cpp maps those itself when it serves or drafts).

A GGUF carries its tokenizer as metadata under llama.cpp's keys (`tokenizer.ggml.tokens`, `.merges`,
`.token_type`, the special token ids, `tokenizer.chat_template`). `tokenizer_files` turns that into
Hugging Face tokenizer files once, with transformers' own GGUF tokenizer converter fed this metadata
(so the vocabulary and special tokens are exactly what `AutoTokenizer.from_pretrained(gguf_file=...)`
gives, without the tensor reading its loader does on the way), and keeps them in a cache directory
named after the file's identity: later processes (an edge's torch-free TextCodec, a replica's tokenizer
fingerprint, `pair check`) read them in a fraction of a second.

Free of torch and transformers at import.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from math import prod
from pathlib import Path

from ..config import ConfigError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # v1 counted in 32 bits; nothing in use still writes it
# The string arrays a tokenizer needs in full; every other string array is read as its length only
# (walking 150k strings one by one is what makes a generic reader slow).
TOKENIZER_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges"})
HEADER_READ = 8 << 20  # bytes read first: the header of a 150k-token vocabulary is about 6 MB
# Ids that end a generation in llama.cpp besides the end-of-sequence one (end of turn, end of message).
END_IDS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# Bump when the files `tokenizer_files` writes change: caches of an older format are then written anew.
TOKENIZER_FORMAT = 1
SOURCE_FILE = "gguf-source.json"  # in a tokenizer cache directory: which file it came from, written last

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# llama_ftype (general.file_type) names of the types in common use, for messages and reports.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              32: "BF16"}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table: its name, its shape (ggml order: fastest-moving first), its type,
    and where its data starts (from the start of the data section)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int = 0

    @property
    def elements(self) -> int:
        """Values the tensor holds."""
        return prod(self.shape)


@dataclass(frozen=True)
class GgufHeader:
    """A GGUF file's metadata and tensor table (`read_header`)."""

    path: Path
    metadata: dict = field(repr=False)
    tensors: tuple[TensorInfo, ...] = field(repr=False)
    # Each metadata key's GGUF value type, and an array's element type (None for a scalar): what
    # writing the value again the same way needs.
    types: dict = field(default_factory=dict, repr=False)
    data_start: int = 0  # where the tensor data begins in the file

    @property
    def architecture(self) -> str:
        """general.architecture: llama, qwen2, ..."""
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default=None):
        """An architecture-scoped key (`<arch>.<key>`, e.g. context_length)."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    @property
    def context_length(self) -> int:
        """The context the model was trained for (0 when the file does not say)."""
        return int(self.arch_value("context_length", 0) or 0)

    @property
    def vocab_size(self) -> int:
        """Rows of the token embedding: the tokenizer's size, else the architecture's vocab_size key."""
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list):
            return len(tokens)
        if isinstance(tokens, int):  # read as a count
            return tokens
        return int(self.arch_value("vocab_size", 0) or 0)

    @property
    def parameters(self) -> int:
        """Values in all the tensors: the model's parameter count."""
        return sum(t.elements for t in self.tensors)

    @property
    def weight_type(self) -> str:
        """The file's weight type as llama.cpp names it (Q8_0, Q4_K_M, ...), or "" when it does not say."""
        file_type = self.metadata.get("general.file_type")
        return FILE_TYPES.get(file_type, f"type {file_type}") if file_type is not None else ""

    @property
    def has_vocabulary(self) -> bool:
        """The file carries a tokenizer (a converted compact drafter's head, fed embeddings, does not)."""
        return self.metadata.get("tokenizer.ggml.model") not in (None, "none", "no_vocab")

    @property
    def tokens(self) -> list[str]:
        """The vocabulary as the file spells it, by id (read with `TOKENIZER_ARRAYS`)."""
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            raise ValueError(f"{self.path}: the vocabulary was not read (read_header with TOKENIZER_ARRAYS)")
        return tokens

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation: end of sequence, and end of turn or message where declared."""
        return tuple(sorted({int(self.metadata[k]) for k in END_IDS if k in self.metadata}))

    @property
    def chat_template(self) -> str | None:
        """tokenizer.chat_template, if the file has one."""
        template = self.metadata.get("tokenizer.chat_template")
        return template if isinstance(template, str) else None

    @cached_property
    def identity(self) -> str:
        """The file's identity (`file_identity`)."""
        return file_identity(self.path)

    def tensor(self, name: str) -> TensorInfo | None:
        """The tensor table's entry of that name, or None."""
        return next((t for t in self.tensors if t.name == name), None)

    def raw_data(self, info: TensorInfo) -> bytes:
        """A tensor's bytes as stored (quantised blocks stay blocks): for copying it into another file."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        with self.path.open("rb") as f:
            f.seek(self.data_start + info.offset)
            return f.read(info.elements // block * size)


def read_header(path: str | Path, strings: frozenset[str] | None = TOKENIZER_ARRAYS) -> GgufHeader:
    """The metadata and tensor table of the GGUF file at `path`; string arrays other than `strings` (None:
    every one is kept) are read as their lengths. ConfigError, naming the file, when it is not a GGUF
    file this reads."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            size, chunk = path.stat().st_size, HEADER_READ
            while True:
                # The header's length is known only once it is parsed: read a prefix, and a longer one
                # if it ends inside (plain reads, not a mapping: the weights are never touched).
                f.seek(0)
                blob = f.read(chunk)
                try:
                    return _parse(path, blob, strings)
                except struct.error:
                    if chunk >= size:
                        raise
                    chunk *= 4
    except (OSError, ValueError, struct.error, UnicodeDecodeError, IndexError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{path} is not a GGUF file this can read ({type(exc).__name__}: {exc})") from None


def _parse(path: Path, blob: bytes, strings: frozenset[str] | None) -> GgufHeader:
    if blob[:4] != MAGIC:
        raise ConfigError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in VERSIONS:
        raise ConfigError(f"{path} is GGUF version {version}; versions {' and '.join(map(str, VERSIONS))} are read")
    pos, metadata, types = 24, {}, {}
    for _ in range(kv_count):
        key, pos = _string(blob, pos)
        (kind,) = struct.unpack_from("<I", blob, pos)
        inner = struct.unpack_from("<I", blob, pos + 4)[0] if kind == _ARRAY else None
        metadata[key], pos = _value(blob, pos + 4, kind, strings is None or key in strings)
        types[key] = (kind, inner)
    tensors = []
    for _ in range(tensor_count):
        name, pos = _string(blob, pos)
        (dims,) = struct.unpack_from("<I", blob, pos)
        shape = struct.unpack_from(f"<{dims}Q", blob, pos + 4)
        pos += 4 + 8 * dims
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        tensors.append(TensorInfo(name, tuple(shape), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", 32))
    return GgufHeader(path, metadata, tuple(tensors), types, (pos + alignment - 1) // alignment * alignment)


def _string(blob: bytes, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    end = pos + 8 + length
    if end > len(blob):
        raise struct.error("the header goes on past what was read")
    return blob[pos + 8:end].decode("utf-8", errors="replace"), end


def _value(blob, pos: int, kind: int, keep_strings: bool):
    """One metadata value and the offset after it; a string array not kept is its length."""
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(blob, pos)
    if kind != _ARRAY:
        raise ValueError(f"metadata value of unknown type {kind}")
    inner, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if inner in _SCALARS:
        fmt = _SCALARS[inner]
        width = struct.calcsize(fmt)
        return list(struct.unpack_from(f"<{count}{fmt[1]}", blob, pos)), pos + count * width
    if inner != _STRING:
        raise ValueError(f"metadata array of type {inner}")
    if keep_strings:
        values = []
        for _ in range(count):
            value, pos = _string(blob, pos)
            values.append(value)
        return values, pos
    for _ in range(count):
        pos += 8 + struct.unpack_from("<Q", blob, pos)[0]
    return count, pos


def file_identity(path: Path) -> str:
    """sha256 over the file's size and 64 KiB samples spread through it: the weights' identity,
    cheap to compute for a file of gigabytes."""
    size = path.stat().st_size
    h = hashlib.sha256(f"gguf:{size}".encode())
    with path.open("rb") as f:
        for i in range(16):
            f.seek(size * i // 16)
            h.update(f.read(1 << 16))
    return h.hexdigest()[:32]


def tokenizer_cache() -> Path:
    """Where tokenizers extracted from GGUF files are kept: beside the pulled models."""
    from .embedded import models_home

    return models_home().parent / "gguf-tokenizers"


def tokenizer_files(path: str | Path, log=None, isolated: bool = False) -> Path:
    """A directory of Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json and the chat
    template) made from the GGUF's metadata: from the cache when it is there, else written to it now
    (about a second: transformers' converter is imported). Where the cache cannot be written, a
    temporary directory is used. ConfigError for a file that carries no vocabulary.

    `isolated`: the writing runs in a child process, so this one never imports transformers (a
    replica serving the file on llama.cpp: some 60 MB it would hold for its life)."""
    cache = tokenizer_cache() / f"{file_identity(Path(path))}-{TOKENIZER_FORMAT}"
    if (cache / SOURCE_FILE).is_file():
        return cache
    header = read_header(path)
    if not header.has_vocabulary:
        raise ConfigError(f"{path} carries no tokenizer (a drafter head that is fed embeddings, not a model "
                          "of its own)")
    if log is not None:
        log(f"reading the tokenizer of {Path(path).name} from its metadata, once")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=cache.parent))
    except OSError:
        staging = Path(tempfile.mkdtemp(prefix="hybridspec-gguf-tokenizer-"))
        _write(header, staging, isolated)
        return staging
    try:
        _write(header, staging, isolated)
        os.rename(staging, cache)
    except OSError:  # another process wrote it meanwhile: theirs is the same
        shutil.rmtree(staging, ignore_errors=True)
        if not (cache / SOURCE_FILE).is_file():
            raise
    return cache


def _write(header: GgufHeader, out: Path, isolated: bool) -> None:
    """_write_tokenizer here, or (`isolated`) in a child process that reads the header again; a failure
    there is a ConfigError carrying the child's last line."""
    if not isolated:
        _write_tokenizer(header, out)
        return
    import subprocess
    import sys

    script = ("import sys; from pathlib import Path; from hybridspec.common.models.gguf_file import "
              "_write_tokenizer, read_header; _write_tokenizer(read_header(sys.argv[1]), Path(sys.argv[2]))")
    run = subprocess.run([sys.executable, "-c", script, str(header.path), str(out)], capture_output=True, text=True)
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
        raise ConfigError(f"cannot make the tokenizer of {header.path} from its metadata: {last}")


def _write_tokenizer(header: GgufHeader, out: Path) -> None:
    """The tokenizer `AutoTokenizer.from_pretrained(gguf_file=...)` would build, saved into `out`, from
    the metadata already read (transformers' own grouping of llama.cpp's keys, then its converter)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING, _SPECIAL_TOKENS,
                                                                       convert_gguf_tokenizer)

    meta = header.metadata
    grouped = {group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, config = grouped["tokenizer"], grouped["tokenizer_config"]
    kind = tokenizer_dict.get("tokenizer_type")
    if kind == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for a sentencepiece vocabulary
    elif kind == "gemma4":
        config["add_bos_token"] = False
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(header.architecture, tokenizer_dict)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **{**config, **extra})
    tokenizer.save_pretrained(str(out))
    source = {"format": TOKENIZER_FORMAT, "gguf": str(header.path.resolve()), "identity": header.identity,
              "end_ids": list(header.end_ids), "context_length": header.context_length}
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")


def end_ids_of(tokenizer_dir: Path) -> tuple[int, ...]:
    """The end-of-generation ids recorded beside a tokenizer `tokenizer_files` wrote (() elsewhere)."""
    source = tokenizer_dir / SOURCE_FILE
    return tuple(json.loads(source.read_text()).get("end_ids", ())) if source.is_file() else ()
