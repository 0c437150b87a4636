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
