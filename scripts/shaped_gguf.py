"""Write a random Q8_0 GGUF with the sizes of a real model and the embedded target's vocabulary, chat
template and special tokens: a file as large as a user's own target, without downloading one, to see how
`cloud serve`'s start scales with the file (docs/models.md):

    python scripts/shaped_gguf.py OUT.gguf [--shape llama-1b]
    python bench/own_models.py start --target OUT.gguf --no-edges
    python bench/own_models.py memory --target OUT.gguf

Its weights are random: it serves (llama.cpp loads it and decodes), but its text is noise.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from hybridspec.common.models.embedded import default_paths

# (hidden, layers, heads, kv heads, intermediate) of real models; the vocabulary is the embedded target's
SHAPES = {"smollm2-360m": (960, 32, 15, 5, 2560), "llama-1b": (2048, 16, 32, 8, 8192),
          "llama-3b": (3072, 28, 24, 8, 8192)}


def write(out: str, shape: str) -> None:
    """Write a random Q8_0 Llama of `shape`'s sizes with the embedded target's vocabulary to `out`."""
    hidden, layers, heads, kv_heads, inter = SHAPES[shape]
    source = gguf.GGUFReader(str(default_paths()["target"] / "model.Q8_0.gguf"))
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name(f"random {shape}")
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for name, field in source.fields.items():  # the vocabulary, special tokens and chat template
        if name.startswith("tokenizer."):
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(name, field.contents(), field.types[0], field.types[-1] if array else None)
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(0)
    scale = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)

    def q8(rows: int, cols: int):
        """Random Q8_0 rows: per block of 32 weights a small f16 scale and 32 random int8."""
        blocks = np.empty((rows * cols // 32, 34), np.uint8)
        blocks[:, :2] = scale
        blocks[:, 2:] = rng.integers(0, 256, (len(blocks), 32), dtype=np.uint8)
        return blocks.reshape(rows, cols // 32 * 34)

    def add(name: str, rows: int, cols: int) -> None:
        writer.add_tensor(name, q8(rows, cols), raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    kv = hidden // heads * kv_heads
    add("token_embd.weight", vocab, hidden)  # tied: the output head too
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        for part, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                 ("attn_output", hidden, hidden), ("ffn_gate", inter, hidden),
                                 ("ffn_up", inter, hidden), ("ffn_down", hidden, inter)):
            add(f"blk.{i}.{part}.weight", rows, cols)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{out}: {Path(out).stat().st_size / 2**20:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the GGUF file to write")
    parser.add_argument("--shape", choices=list(SHAPES), default="llama-1b")
    args = parser.parse_args()
    write(args.out, args.shape)


if __name__ == "__main__":
    main()
