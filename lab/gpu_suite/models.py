"""The model shapes the suite times, with random weights: a forward pass costs the same whatever
the weights' values, so no checkpoint has to travel to the GPU machine (docs/engine.md)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaConfig

from ...cloud.core.verifier import Verifier, VerifierLimits
from ...cloud.engine.factory import ServedTarget
from ...cloud.engine.llama import LlamaWeights, random_weights
from ...cloud.engine.torch_engine import EngineOptions, TorchEngine

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# The published configs' shapes (hidden sizes, heads, vocabularies, rope): SmolLM2-135M (our target),
# Llama-3.2-1B and Llama-3.1-8B.
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, rms_norm_eps=1e-5),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, head_dim=64,
                         rope_parameters={**_LLAMA3_ROPE, "factor": 32.0}, rms_norm_eps=1e-5),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                         rope_parameters={**_LLAMA3_ROPE, "factor": 8.0}, rms_norm_eps=1e-5),
    # For the suite's quick CPU form and its tests: the same code on a model that runs in moments.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5),
}


def config_of(shape: str, max_positions: int) -> LlamaConfig:
    """The shape's Llama config."""
    return LlamaConfig(max_position_embeddings=max_positions, **SHAPES[shape])


@dataclass
class Bench:
    """A shape's engine and the verifier core over it."""

    shape: str
    engine: TorchEngine
    verifier: Verifier


class _Vocabulary:
    """The identity of a target with no text: random weights come with no tokenizer."""

    all_special_tokens: list[str] = []

    def get_vocab(self) -> dict[str, int]:
        return {}


def build(shape: str, device: str, dtype: torch.dtype, limits: VerifierLimits, graphs: bool | None = None,
          seed: int = 0, options: EngineOptions | None = None, weights: LlamaWeights | None = None) -> Bench:
    """Random weights of `shape` on `device` (or `weights`, shared with another engine), a torch engine
    over them (`options`; CUDA graphs captured on a GPU unless `graphs` is False) and a verifier with
    `limits`."""
    config = config_of(shape, limits.max_context)
    weights = weights or random_weights(config, limits.max_context, dtype, device, seed)
    engine = TorchEngine(weights, limits.kv_cache_tokens, limits.max_context, graphs, options=options)
    target = ServedTarget(f"random {shape}", _Vocabulary(), config.vocab_size, (), f"random-{shape}-{seed}")
    return Bench(shape, engine, Verifier(target, limits, engine))
