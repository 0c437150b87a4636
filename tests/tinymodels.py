"""Tiny random Llama-style models with a real tokenizer, built from a config: no downloads. The tests'
target and the benchmarks' `--target tiny` (bench/harness.py's tiny_target)."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hybridspec.common.models.loading import LoadedModel

VOCAB = 256
EOS_ID = 2
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def make_tokenizer(prefix: str = "w") -> PreTrainedTokenizerFast:
    """A word-level tokenizer over '<prefix>4'..'<prefix>255' plus four special tokens."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"{prefix}{i}": i for i in range(len(SPECIALS), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    # Words outside the vocabulary become <unk>; enough to exercise every chat-prompt code path.
    fast.chat_template = "<s>{% for m in messages %}{{ m['content'] }} w4 {% endfor %}"
    return fast


def make_model(seed: int, layers: int = 2, hidden: int = 64) -> LlamaForCausalLM:
    """A random Llama; larger init than default so its greedy outputs vary from token to token."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=EOS_ID,
                         pad_token_id=3, initializer_range=0.2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=EOS_ID, pad_token_id=3, bos_token_id=1)
    return model


def save_model(model: LlamaForCausalLM, out: Path, tokenizer_prefix: str = "w") -> Path:
    """Save model and tokenizer as a normal HF directory."""
    model.save_pretrained(out)
    make_tokenizer(tokenizer_prefix).save_pretrained(out)
    return out


def greedy_reference(target: LoadedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """What the target alone produces with Hugging Face greedy decoding."""
    out = target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                pad_token_id=target.eos_token_ids[0])
    return out[0, len(prompt):].tolist()


# Edge settings that send every token through verification rounds of exactly max_draft (no adaptive
# block length, no hand-over to cloud-only decoding): what the verification tests exercise.
EVERY_ROUND = dict(gamma_policy="fixed", cloud_only_switch=False)


def save_gguf(out: Path, letters: str = "abcdefghij", layers: int = 1, hidden: int = 64, seed: int = 0,
              chat_template: str | None = None) -> Path:
    """A tiny random Llama as a GGUF file (F32) with a byte-level BPE vocabulary of its own: `letters`,
    every pair of them (and the merge making it), then the end-of-sequence token `</s>`. Enough for its
    tokenizer to be read and compared and for llama.cpp to load and run it: what a user's GGUF of
    another family looks like to the pair check."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    merges = [f"{a} {b}" for a in letters for b in letters]
    tokens = [*letters, *(m.replace(" ", "") for m in merges), "</s>"]
    heads, kv_heads, n = 4, 2, len(tokens)
    kv_dim = hidden // heads * kv_heads

    def matrix(rows: int, cols: int):
        return (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(out.stem)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (n - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(n - 1)
    writer.add_bos_token_id(n - 1)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.add_tensor("token_embd.weight", matrix(n, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("output.weight", matrix(n, hidden))
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv_dim, hidden)), ("attn_v", (kv_dim, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (2 * hidden, hidden)),
                            ("ffn_up", (2 * hidden, hidden)), ("ffn_down", (hidden, 2 * hidden))):
            writer.add_tensor(f"blk.{i}.{name}.weight", matrix(*shape))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
