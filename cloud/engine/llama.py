"""A Llama-family decoder (Llama 2/3.x, SmolLM2, Qwen2-style q/k/v biases) as plain tensors and one
forward function: what the torch engine runs, on a CPU or inside CUDA graphs.

The weights are fused where the maths allows (q|k|v, gate|up) so that a layer is four matrix
products. The forward never decides how a product, a norm or attention is computed: `ops` does
(cloud/engine/torch_ops.py on a CPU, cloud/engine/triton_ops.py on CUDA), and every op it calls computes
each row from that row's inputs alone, in an order fixed by the shapes of the weights. That is what
makes a token's logits the same bits whether it is decoded alone, scored inside a block, batched with
other sessions or scored as a node of a draft tree (docs/engine.md, "Exactness by construction").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # transformers is imported when weights are read: a llama.cpp replica never needs it
    from transformers import LlamaConfig, PretrainedConfig, PreTrainedModel

SERVED_MODEL_TYPES = ("llama", "qwen2")  # the same block; Qwen2 adds q/k/v biases


@dataclass(frozen=True)
class LlamaShape:
    """The sizes a forward pass and a KV pool need."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    @classmethod
    def of(cls, config: PretrainedConfig) -> LlamaShape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads, head_dim, config.intermediate_size, config.vocab_size,
                   float(config.rms_norm_eps))


def unsupported_reason(config: PretrainedConfig) -> str | None:
    """Why this forward cannot serve a model with this config, or None."""
    if config.model_type not in SERVED_MODEL_TYPES:
        return f"its model_type is {config.model_type!r}; the engine serves {', '.join(SERVED_MODEL_TYPES)}"
    types = getattr(config, "layer_types", None) or ["full_attention"]
    if any(t != "full_attention" for t in types) or getattr(config, "use_sliding_window", False):
        return "it has sliding-window layers; the engine serves full-attention decoders"
    if getattr(config, "num_key_value_heads", None) is None:
        return "its config names no num_key_value_heads"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"its activation is {config.hidden_act}; the engine serves SiLU-gated MLPs"
    if getattr(config, "mlp_bias", False):
        return "its MLP has biases"
    return None


@dataclass
class Layer:
    """One decoder block's weights (`[out, in]` matrices, as nn.Linear stores them)."""

    attn_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


@dataclass
class LlamaWeights:
    """Every tensor of the forward pass, on one device in one dtype, plus the rotary tables."""

    shape: LlamaShape
    embed: torch.Tensor
    layers: list[Layer]
    norm: torch.Tensor
    lm_head: torch.Tensor
    cos: torch.Tensor  # [positions, head_dim] in the weights' dtype, as Hugging Face rounds them
    sin: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def positions(self) -> int:
        """Positions the rotary tables cover."""
        return self.cos.shape[0]


def from_model(model: PreTrainedModel, positions: int) -> LlamaWeights:
    """The weights of a loaded Hugging Face causal LM (copies only the fused matrices)."""
    reason = unsupported_reason(model.config)
    if reason:
        raise ValueError(f"cannot serve {type(model).__name__}: {reason}")
    inner = model.get_decoder()

    def cat(*tensors: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensors[0] is None else torch.cat(tensors).contiguous()

    layers = []
    for block in inner.layers:
        attn, mlp = block.self_attn, block.mlp
        layers.append(Layer(
            attn_norm=block.input_layernorm.weight.detach(),
            qkv=cat(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight).detach(),
            qkv_bias=cat(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias),
            o=attn.o_proj.weight.detach(), o_bias=attn.o_proj.bias,
            mlp_norm=block.post_attention_layernorm.weight.detach(),
            gate_up=cat(mlp.gate_proj.weight, mlp.up_proj.weight).detach(), down=mlp.down_proj.weight.detach()))
    cos, sin = rope_tables(model.config, positions, model.dtype, model.device)
    return LlamaWeights(LlamaShape.of(model.config), inner.embed_tokens.weight.detach(), layers,
                        inner.norm.weight.detach(), model.get_output_embeddings().weight.detach(), cos, sin)


def random_weights(config: LlamaConfig, positions: int, dtype: torch.dtype, device: torch.device | str,
                   seed: int = 0) -> LlamaWeights:
    """Weights of the config's shape drawn at random (no checkpoint): for timing a model's shape,
    which does not depend on the values, and for tests."""
    shape = LlamaShape.of(config)
    gen = torch.Generator(device=device).manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32) * cols ** -0.5).to(dtype)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(shape.hidden, generator=gen, device=device)).to(dtype)

    qkv_rows = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    bias = config.model_type == "qwen2"
    layers = [Layer(norm(), mat(qkv_rows, shape.hidden),
                    (0.1 * torch.randn(qkv_rows, generator=gen, device=device)).to(dtype) if bias else None,
                    mat(shape.hidden, shape.heads * shape.head_dim), None, norm(),
                    mat(2 * shape.intermediate, shape.hidden), mat(shape.hidden, shape.intermediate))
              for _ in range(shape.layers)]
    embed = mat(shape.vocab, shape.hidden) * shape.hidden ** 0.5
    head = embed if config.tie_word_embeddings else mat(shape.vocab, shape.hidden)
    cos, sin = rope_tables(config, positions, dtype, torch.device(device))
    return LlamaWeights(shape, embed, layers, norm(), head, cos, sin)


def rope_tables(config: PretrainedConfig, positions: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position, computed by Hugging Face's own rotary module for the config (so
    every rope scaling it knows is honoured) in float32 and rounded to `dtype` as its models do."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config).to(device)
    probe = torch.zeros(1, device=device, dtype=torch.float32)
    cos, sin = rotary(probe, torch.arange(positions, device=device)[None])
    return cos[0].to(dtype).contiguous(), sin[0].to(dtype).contiguous()


class Ops(Protocol):
    """The kernels a forward pass needs. Each computes a row from that row alone (see module doc)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, parts: tuple[int, ...] = ()) -> torch.Tensor:
        """x @ weight.T (+ bias), in out_dtype (default x's). `parts`: the row counts of the matrices
        fused in `weight`, for a backend that multiplies them one by one (a CPU's library is faster so)."""

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """LlamaRMSNorm of every row."""

    def add_rmsnorm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, rmsnorm(x + delta)): a residual add and the next norm."""

    def rope_and_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, heads: int) -> torch.Tensor:
        """The rotated queries `[T, heads, D]` of a fused q|k|v product; the rotated keys and the values
        are written to `keys[rows]` and `values[rows]` (`[pool rows, kv_heads, D]`)."""

    def qkv_rope_cache(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                       sin: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor, heads: int) -> torch.Tensor:
        """rope_and_cache(linear(h, weight, bias), ...): the q|k|v product, rotated and cached, each row
        exactly as the two ops compute it (a backend may fuse them)."""

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a fused gate|up product."""

    def silu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """silu_mul(gate_up) @ weight.T (the down product), each row exactly as the two ops compute it
        (a backend may fuse them)."""

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: object,
                  scale: float) -> torch.Tensor:
        """Each group's queries over its keys (cloud/engine/batch.py)."""


@dataclass
class PassInputs:
    """One pass's tokens, packed one after another (padding rows at the end write to a scratch row)."""

    ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: each token's position in its session
    write_rows: torch.Tensor  # [T] int64: the KV pool row each token's key and value go to
    meta: object  # the attention groups (cloud/engine/batch.py GroupTensors)
    logit_rows: torch.Tensor | None = None  # rows whose logits are computed, in this order (None: all)


def forward(w: LlamaWeights, keys: torch.Tensor, values: torch.Tensor, inputs: PassInputs,
            ops: Ops) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Logits (float32, one row per `logit_rows` entry, or per token; None for no rows) and final hidden
    states (`[T, hidden]`, after the final norm) of a pass; writes every token's keys and values to
    `keys[layer][write_rows]` / `values[...]` on the way."""
    s = w.shape
    t = inputs.ids.shape[0]
    scale = s.head_dim ** -0.5
    x = F.embedding(inputs.ids, w.embed)
    h = ops.rmsnorm(x, w.layers[0].attn_norm, s.eps)
    for i, layer in enumerate(w.layers):
        # 1. Attention: q, k, v in one product; rotary on q and k; this pass's keys join the pool first.
        q = ops.qkv_rope_cache(h, layer.qkv, layer.qkv_bias, w.cos, w.sin, inputs.positions, inputs.write_rows,
                               keys[i], values[i], s.heads)
        attended = ops.attention(q, keys[i], values[i], inputs.meta, scale)
        x, h = ops.add_rmsnorm(x, ops.linear(attended.reshape(t, s.heads * s.head_dim), layer.o, layer.o_bias),
                               layer.mlp_norm, s.eps)
        # 2. The gated MLP; its residual add goes with the next norm (the next layer's, or the final one).
        down = ops.silu_linear(ops.linear(h, layer.gate_up, parts=(s.intermediate, s.intermediate)), layer.down)
        x, h = ops.add_rmsnorm(x, down, w.layers[i + 1].attn_norm if i + 1 < s.layers else w.norm, s.eps)
    rows = inputs.logit_rows
    if rows is not None and rows.numel() == 0:
        return None, h
    return ops.linear(h if rows is None else h[rows], w.lm_head, out_dtype=torch.float32), h
