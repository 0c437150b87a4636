"""A compact drafter (common/models/compact.py) as a GGUF file llama.cpp runs, and finding it again.

A compact drafter reads any of the target's ids but predicts over only the `head_ids` rows of the
target's head, while llama.cpp ties its vocabulary to both ends: `token_embd` and the output head have
n_vocab rows. So the GGUF's vocabulary is the head: n_vocab = len(head_ids), its one `token_embd`
tensor is the head's rows (llama.cpp uses it as the output head when there is no `output` tensor),
and the model is fed *input embeddings* rather than ids: rows of the target's embedding matrix, which
is saved beside it (fp16 .npy, gathered in numpy at run time, so no torch model is needed to draft).
llama.cpp's tokenizer is never used: the vocabulary is declared `no_vocab` with a size, the least its
loader accepts. Files written into the drafter's directory:

  drafter.gguf            arch "llama", the drafter's layers in F16, Q8_0 or Q4_0, norms in F32; an int8
                          checkpoint (the shipped one) becomes Q8_0 without rounding again
  input-embeddings.npy    the target's token embeddings, fp16, [target vocab, hidden]
  llamacpp-drafter.json   what was converted from what; written last, so it marks a complete conversion

Free of torch and gguf at import (the edge's config reads `DrafterEngine` from here).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..config import Choice, choice
from .gguf import find_gguf, llama_cpp_loads
from .manifest import EAGLE_KIND, MANIFEST, WEIGHTS, Manifest, resolve_base

GGUF_NAME = "drafter.gguf"
EMBEDDINGS_NAME = "input-embeddings.npy"
RECORD_NAME = "llamacpp-drafter.json"
FORMAT = 2  # bump when the conversion changes: older conversions are then found stale and redone
GGUF_WEIGHTS = ("F16", "Q8_0", "Q4_0")  # what the drafter's matrices can be stored as
# Q8_0: the shipped int8 weights exactly, 1.3-1.5x faster per token than F16 at half the size; its
# greedy choices are the torch drafter's at 98.5 % of positions (llama.cpp multiplies Q8_0 weights by
# 8-bit activations, which parts near-ties) and agree with the target's exactly as often. F16 matches
# at 99.5-100 %; Q4_0 is faster still but matches at 75 % and agrees with the target less
# (92253c5:bench/llamacpp_drafter.py, docs/engine/llamacpp-drafter.json).
DEFAULT_GGUF_WEIGHTS = "Q8_0"


class DrafterEngine(Choice):
    """What runs a plain drafter LM on the edge (an EAGLE head always runs on torch)."""

    AUTO = "auto"  # llama.cpp on a CPU when the drafter has a converted GGUF and llama-cpp-python loads
    TORCH = "torch"  # the checkpoint in torch: GPUs, and the reference
    LLAMACPP = "llamacpp"  # the converted GGUF in llama.cpp's CPU kernels


@dataclass(frozen=True)
class LlamaDraftFiles:
    """What llama.cpp drafts with, and how: a compact drafter's converted GGUF fed the target's input
    embeddings, or a GGUF model of its own (`embeddings` None), fed token ids over its own vocabulary."""

    gguf: Path
    embeddings: Path | None  # the target's input embeddings, fp16 [target vocab, hidden]; None: fed ids
    weights: str  # the GGUF's weight type (a GGUF_WEIGHTS type for a converted drafter)
    head_rows: int  # the GGUF's vocabulary: len(head_ids), or a whole model's vocabulary
    threads: int = 1  # llama.cpp threads


def source_digest(path: Path) -> str:
    """The drafter's identity: its manifest and own weights (a re-distilled drafter gets a new one)."""
    h = hashlib.sha256(f"hybridspec-drafter-gguf:{FORMAT}".encode())
    for name in (MANIFEST, WEIGHTS):
        with (path / name).open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:32]


def find_converted(path: Path, threads: int = 1) -> LlamaDraftFiles | None:
    """The drafter directory's conversion if it is complete and of these very weights, else None."""
    record = path / RECORD_NAME
    try:
        meta = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    files = LlamaDraftFiles(path / GGUF_NAME, path / EMBEDDINGS_NAME, meta.get("weights", ""),
                            int(meta.get("head_rows", 0)), threads)
    if meta.get("source") != source_digest(path) or not (files.gguf.is_file() and files.embeddings.is_file()):
        return None
    return files


def pick_engine(engine: str, path: Path, device_type: str, dtype: str, threads: int = 1) -> LlamaDraftFiles | None:
    """The converted files when `engine` resolves to llama.cpp for the compact drafter at `path`, None
    for torch. auto: llama.cpp on a CPU with no dtype asked for, when the conversion is there and
    llama-cpp-python loads. llamacpp: FileNotFoundError naming the fix when it cannot be."""
    engine = choice(DrafterEngine, engine, "drafter_engine")
    if engine is DrafterEngine.TORCH or not convertible(path):
        return None
    files = find_converted(path, threads)
    if engine is DrafterEngine.LLAMACPP:
        if files is None:
            raise FileNotFoundError(f"drafter {path} has no llama.cpp conversion: run "
                                    f"`hybridspec models convert-drafter {path}`")
        if not llama_cpp_loads():
            raise FileNotFoundError("the llama.cpp drafter engine needs llama-cpp-python, which does not load")
        return files
    usable = device_type == "cpu" and str(dtype) == "auto" and files is not None
    return files if usable and llama_cpp_loads() else None


def gguf_drafter_files(path: Path, engine: str, device_type: str, dtype: str, threads: int = 1) -> LlamaDraftFiles | None:
    """How llama.cpp drafts with the GGUF model at `path` (its own vocabulary, fed ids) when `engine`
    resolves to llama.cpp, None for torch: auto = llama.cpp on a CPU with no dtype asked for, when
    llama-cpp-python loads. ConfigError in one line for a GGUF that is no model of its own (a compact
    drafter's converted head, fed embeddings), and for llamacpp where it cannot run."""
    from ..config import ConfigError
    from .gguf_file import read_header

    engine = choice(DrafterEngine, engine, "drafter_engine")
    header = read_header(path, strings=frozenset())
    if not header.has_vocabulary:
        raise ConfigError(f"{path} is a compact drafter's head converted for llama.cpp (it is fed its target's "
                          "embeddings, and carries no vocabulary): give the drafter's directory instead, or write "
                          "a GGUF of its own with `hybridspec models export-drafter`")
    if engine is DrafterEngine.TORCH:
        return None
    if engine is DrafterEngine.LLAMACPP and not llama_cpp_loads():
        raise ConfigError("the llama.cpp drafter engine needs llama-cpp-python, which does not load")
    if engine is DrafterEngine.AUTO and not (device_type == "cpu" and str(dtype) == "auto" and llama_cpp_loads()):
        return None
    return LlamaDraftFiles(path, None, header.weight_type, header.vocab_size, threads)


def convertible(path: Path) -> bool:
    """True for a compact drafter LM (an EAGLE head drafts from the target's features: torch only)."""
    manifest = path / MANIFEST
    return manifest.is_file() and json.loads(manifest.read_text()).get("kind", "model") != EAGLE_KIND


def convert_drafter(path: Path, weights: str = DEFAULT_GGUF_WEIGHTS, log=print) -> LlamaDraftFiles:
    """Write the compact drafter at `path` as a GGUF (and the target's input embeddings) into `path`;
    the record is written last, so an interrupted conversion is simply not found."""
    import numpy as np
    import torch

    from .compact import load_compact

    if weights not in GGUF_WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(GGUF_WEIGHTS)}, got {weights!r}")
    if not convertible(path):
        raise ValueError(f"{path} is not a compact drafter LM (an EAGLE head runs on torch only)")
    log(f"writing the drafter's weights as a {weights} GGUF for llama.cpp, once (a few seconds)")
    (path / RECORD_NAME).unlink(missing_ok=True)
    model, _, head_ids = load_compact(path, torch.float32)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    partial = path / (GGUF_NAME + ".partial")
    write_gguf(partial, model.config, state, weights, path.name.removesuffix(".partial"), _int8_matrices(path))
    os.replace(partial, path / GGUF_NAME)
    embeddings = path / (EMBEDDINGS_NAME + ".partial.npy")  # np.save keeps a name ending in .npy
    np.save(embeddings, state["model.embed_tokens.weight"].astype(np.float16))
    os.replace(embeddings, path / EMBEDDINGS_NAME)
    files = LlamaDraftFiles(path / GGUF_NAME, path / EMBEDDINGS_NAME, weights, int(head_ids.numel()))
    record = {"format": FORMAT, "source": source_digest(path), "weights": weights, "head_rows": files.head_rows,
              "target_vocab": int(state["model.embed_tokens.weight"].shape[0])}
    (path / RECORD_NAME).write_text(json.dumps(record, indent=1) + "\n")
    return files


def _int8_matrices(path: Path) -> dict:
    """The drafter's matrices stored as int8 with a per-row scale: name -> (int8 [R, C], fp16 scale [R])."""
    from safetensors import safe_open

    from .compact import SCALE_SUFFIX

    with safe_open(path / WEIGHTS, framework="np") as f:
        names = set(f.keys())
        return {n: (f.get_tensor(n), f.get_tensor(n + SCALE_SUFFIX)) for n in names if n + SCALE_SUFFIX in names}


def write_gguf(out: Path, config, state: dict, weights: str, name: str, int8: dict | None = None) -> None:
    """A Llama drafter's numpy state dict (Hugging Face names; `lm_head.weight` = the head's rows) as a
    llama.cpp GGUF whose vocabulary is those rows. `int8`: matrices stored as int8 with a per-row scale
    (`_int8_matrices`), which Q8_0 then holds exactly (see `_q8_0_exact`)."""
    import gguf
    import numpy as np

    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError("only Llama drafters without biases convert")
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    head = state["lm_head.weight"]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(_rope_theta(config)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type({"F16": gguf.LlamaFileType.MOSTLY_F16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[weights])
    writer.add_vocab_size(head.shape[0])
    writer.add_tokenizer_model("no_vocab")  # never used: the drafter is fed embeddings
    # The head is a quarter of the work; Q4_0 keeps it at Q8_0, as llama.cpp's quantiser keeps heads finer.
    _add_matrix(writer, "token_embd.weight", head, "Q8_0" if weights == "Q4_0" else weights)
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].astype(np.float32))
    expected = {"lm_head.weight", "model.norm.weight", "model.embed_tokens.weight"}
    expected |= _add_layers(writer, state, config.num_hidden_layers, n_head, n_kv, weights, int8)
    unused = sorted(set(state) - expected)
    if unused:
        raise ValueError(f"the drafter has weights a Llama GGUF has no place for: {', '.join(unused[:3])}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _add_layers(writer, state: dict, layers: int, n_head: int, n_kv: int, weights: str, int8: dict | None) -> set[str]:
    """The decoder layers of a Llama numpy state dict (Hugging Face names) as llama.cpp's `blk.*`
    tensors, q/k rows in llama.cpp's rope order; int8 matrices as Q8_0 exactly. The keys written."""
    import gguf
    import numpy as np

    written = set()
    for i in range(layers):
        for hf, ours in LAYER_NAMES.items():
            key = f"model.layers.{i}.{hf}.weight"
            written.add(key)
            heads = {"self_attn.q_proj": n_head, "self_attn.k_proj": n_kv}.get(hf)
            rows = (lambda t: permute_rope(t, heads)) if heads else (lambda t: t)  # noqa: E731
            tensor = rows(state[key])
            stored = (int8 or {}).get(key)
            if tensor.ndim == 1:
                writer.add_tensor(f"blk.{i}.{ours}.weight", tensor.astype(np.float32))
            elif weights == "Q8_0" and stored is not None and tensor.shape[-1] % 32 == 0:
                q8 = _q8_0_exact(rows(stored[0]), rows(stored[1]))
                writer.add_tensor(f"blk.{i}.{ours}.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                _add_matrix(writer, f"blk.{i}.{ours}.weight", tensor, weights)
    return written


# Keys of the target's header the exported drafter does not copy: the writer sets these itself.
_NOT_COPIED = ("general.architecture", "general.file_type", "general.name", "general.alignment")


def export_drafter(path: Path, out: Path, weights: str = DEFAULT_GGUF_WEIGHTS, log=print) -> Path:
    """The compact drafter LM at `path` as a GGUF model of its own at `out`, which llama.cpp (the
    edge's drafter engine, or any llama.cpp tool) runs fed token ids: its layers and final norm in
    `weights`, and from its target's GGUF the token embeddings, the output head (when not tied to
    them) and every tokenizer and architecture key, copied as stored (nothing is de-quantised). The
    head is then the target's whole head, not the drafter's slice of it: the drafter predicts the same
    over the slice and may now pick tokens outside it. Llama-architecture targets only; ConfigError,
    in one line, otherwise and for a target with no GGUF."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    from ..config import ConfigError
    from .compact import SCALE_SUFFIX
    from .gguf_file import read_header

    if weights not in GGUF_WEIGHTS:
        raise ConfigError(f"weights must be one of {', '.join(GGUF_WEIGHTS)}, got {weights!r}")
    if not convertible(path):
        raise ConfigError(f"{path} is not a compact drafter LM (an EAGLE head drafts from its target's features)")
    manifest = Manifest(**json.loads((path / MANIFEST).read_text()))
    base = resolve_base(path, manifest)
    base_gguf = find_gguf(base)
    if base_gguf is None:
        raise ConfigError(f"the drafter's target {base} has no GGUF file to take the embeddings and tokenizer from")
    target = read_header(base_gguf, strings=None)
    if target.architecture != "llama":
        raise ConfigError(f"export-drafter writes llama-architecture drafters; the target {base_gguf} is "
                          f"{target.architecture}")
    log(f"writing {out}: the drafter's {manifest.num_layers} layers in {weights}, the embeddings and tokenizer of "
        f"{base_gguf.name} as stored")
    with safe_open(path / WEIGHTS, framework="np") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    int8 = {k: (v, stored[k + SCALE_SUFFIX]) for k, v in stored.items() if k + SCALE_SUFFIX in stored}
    state = {k: (v.astype(np.float32) * stored[k + SCALE_SUFFIX].astype(np.float32)[:, None] if k in int8
                 else v.astype(np.float32))
             for k, v in stored.items() if k != "head_ids" and not k.endswith(SCALE_SUFFIX)}
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), "llama")
    for key, value in target.metadata.items():
        if key in _NOT_COPIED or key == "llama.block_count":
            continue
        kind, inner = target.types[key]
        writer.add_key_value(key, value, gguf.GGUFValueType(kind), None if inner is None else gguf.GGUFValueType(inner))
    writer.add_name(out.stem)
    writer.add_block_count(manifest.num_layers)
    writer.add_file_type({"F16": gguf.LlamaFileType.MOSTLY_F16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[weights])
    for name in ("token_embd.weight", "output.weight"):  # no output.weight: the head is tied to the embeddings
        info = target.tensor(name)
        if info is not None:
            raw = np.frombuffer(target.raw_data(info), dtype=np.uint8)
            rows = info.shape[1] if len(info.shape) > 1 else 1
            writer.add_tensor(name, raw.reshape(rows, -1), raw_dtype=gguf.GGMLQuantizationType(info.ggml_type))
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    written = _add_layers(writer, state, manifest.num_layers, int(target.arch_value("attention.head_count")),
                          int(target.arch_value("attention.head_count_kv")), weights, int8)
    unused = sorted(set(state) - written - {"model.norm.weight"})
    if unused:
        partial.unlink(missing_ok=True)
        raise ConfigError(f"the drafter has weights a Llama GGUF has no place for: {', '.join(unused[:3])}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, out)
    return out


def permute_rope(weight, heads: int):
    """A Hugging Face Llama q/k projection's rows in llama.cpp's rope order: HF rotates the two halves
    of each head's dimensions, llama.cpp ("normal" rope) adjacent pairs (convert_hf_to_gguf's permute)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _q8_0_exact(q, scale):
    """Q8_0 blocks (an fp16 scale, then 32 int8 values) holding an int8 matrix with one fp16 scale per
    row exactly: every block of a row takes the row's scale. Quantising the dequantised values
    instead would round them a second time (to a scale per block), a drafter that is not the one shipped."""
    import numpy as np

    rows, cols = q.shape
    blocks = q.astype(np.int8).reshape(rows, cols // 32, 32).view(np.uint8)
    d = np.broadcast_to(scale.astype(np.float16).reshape(rows, 1, 1), (rows, cols // 32, 1)).copy().view(np.uint8)
    return np.concatenate([d, blocks], axis=-1).reshape(rows, cols // 32 * 34)


def _rope_theta(config) -> float:
    """The rope base; ValueError for scaled rope (llama3, yarn, ...), which this conversion does not write."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params.get("rope_type", params.get("type", "default")) != "default":
        raise ValueError(f"only plain rope converts, not {params.get('rope_type', params.get('type'))}")
    return params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0


def _add_matrix(writer, name: str, tensor, weights: str) -> None:
    """A matrix in `weights`; F16 for a row length the type's blocks do not divide (tiny test models)."""
    import gguf
    import numpy as np

    qtype = getattr(gguf.GGMLQuantizationType, weights)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if weights == "F16" or tensor.shape[-1] % block:
        writer.add_tensor(name, tensor.astype(np.float16))
        return
    writer.add_tensor(name, gguf.quants.quantize(tensor.astype(np.float32), qtype), raw_dtype=qtype)
