"""One forward pass for many sessions, each with its own KV cache (docs/design.md §3, batching).

Sessions hold caches of different lengths and send blocks of different lengths. The batch is
built by left-padding every cache to the longest one and right-padding every block to the
longest one; an attention mask hides the padding and explicit position ids keep each session's
positions its own, so each row computes what it would have computed alone. After the pass, each
session's cache is cut back out of the batch without its padding.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel


def supports_batching(model: PreTrainedModel) -> bool:
    """Padding-based batching needs plain full-attention layers (no sliding windows, no recurrent state)."""
    types = getattr(model.config, "layer_types", None) or ["full_attention"]
    return all(t == "full_attention" for t in types)


@torch.inference_mode()
def batched_forward(model: PreTrainedModel, caches: Sequence[DynamicCache],
                    feeds: Sequence[Sequence[int]]) -> tuple[list[torch.Tensor], list[DynamicCache]]:
    """Feed `feeds[i]` after `caches[i]` for every i in one pass.

    Returns float32 CPU logits `[len(feeds[i]), V]` per session and new caches holding the old
    context plus the fed tokens; the input caches are not modified.
    """
    if len(caches) != len(feeds) or not feeds:
        raise ValueError("batched_forward needs one non-empty feed per cache")
    if any(len(f) == 0 for f in feeds):
        raise ValueError("every feed needs at least one token")
    device = model.device
    config = model.config
    past = [c.get_seq_length() for c in caches]
    new = [len(f) for f in feeds]
    width, steps = max(past), max(new)
    batch = len(feeds)

    ids = torch.zeros(batch, steps, dtype=torch.long, device=device)
    mask = torch.zeros(batch, width + steps, dtype=torch.long, device=device)
    positions = torch.zeros(batch, steps, dtype=torch.long, device=device)
    for i, (feed, p, n) in enumerate(zip(feeds, past, new)):
        ids[i, :n] = torch.tensor(list(feed), dtype=torch.long)
        mask[i, width - p: width + n] = 1
        # Padded steps get positions too (they are masked out and their outputs dropped).
        positions[i] = torch.arange(p, p + steps)

    joined = DynamicCache(config=config)
    if width:
        for layer in range(config.num_hidden_layers):
            joined.update(_stack([_layer(c, layer, "keys") for c in caches], width),
                          _stack([_layer(c, layer, "values") for c in caches], width), layer)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=joined, use_cache=True)
    logits = [out.logits[i, :n].float().cpu() for i, n in enumerate(new)]

    split = []
    for i, (p, n) in enumerate(zip(past, new)):
        cache = DynamicCache(config=config)
        for layer in range(config.num_hidden_layers):
            kept = slice(width - p, width + n)
            cache.update(joined.layers[layer].keys[i:i + 1, :, kept].contiguous(),
                         joined.layers[layer].values[i:i + 1, :, kept].contiguous(), layer)
        split.append(cache)
    return logits, split


def _layer(cache: DynamicCache, layer: int, which: str) -> torch.Tensor | None:
    if layer >= len(cache.layers) or not cache.layers[layer].is_initialized:
        return None
    return getattr(cache.layers[layer], which)


def _stack(kvs: list[torch.Tensor | None], width: int) -> torch.Tensor:
    """Per-session `[1, H, n_i, D]` (None for an empty cache) -> `[B, H, width, D]`, zeros in front."""
    ref = next(kv for kv in kvs if kv is not None)
    rows = []
    for kv in kvs:
        n = 0 if kv is None else kv.shape[-2]
        pad = ref.new_zeros(1, ref.shape[1], width - n, ref.shape[3])
        rows.append(pad if kv is None else torch.cat([pad, kv], dim=-2) if n < width else kv)
    return torch.cat(rows)
