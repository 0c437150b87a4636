"""The language-model half of a drafter: logits after a context, with a KV cache kept across calls.

`ModelDrafter` (edge/drafter.py) owns what a drafter decides — sampling, the BiLD fallback, stop ids,
the exact q it sends — and asks a `DraftLM` only for logits over the target's whole vocabulary, so the
same decisions run over either implementation: `TorchLM` here (a Hugging Face model and its
DynamicCache: GPUs, EAGLE heads' fallbacks, and the reference), or `LlamaCppLM`
(edge/llamacpp_lm.py: the drafter's converted GGUF in llama.cpp's CPU kernels).
"""
from __future__ import annotations

from typing import Protocol

import torch
from transformers import DynamicCache

from ..common.models.loading import LoadedModel, truncate_cache


class DraftLM(Protocol):
    """A drafter LM behind a cache: every call returns float32 CPU logits [target vocab] (ids the
    drafter cannot predict get -inf) for the position after everything fed so far."""

    def advance(self, context: list[int]) -> torch.Tensor:
        """Make the cache hold `context`, reusing the longest cached prefix (at least the last token
        is fed again, for its logits) and cutting the rest."""
        ...

    def feed(self, ids: list[int]) -> torch.Tensor:
        """Append `ids` to the cache."""
        ...


def reusable_prefix(cached: list[int], context: list[int]) -> int:
    """How many leading cached tokens `context` keeps; never all of it, since the last token must be
    fed to get the logits after it."""
    keep, limit = 0, min(len(cached), len(context) - 1)
    while keep < limit and cached[keep] == context[keep]:
        keep += 1
    return keep


def to_vocab(logits: torch.Tensor, head_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """A drafter's head logits as float32 CPU logits over the target's vocabulary."""
    logits = logits.float().cpu()
    if head_ids is not None:
        # A compact drafter predicts over a subset of the vocabulary; the rest gets no mass.
        full = torch.full((vocab_size,), float("-inf"))
        full[head_ids] = logits
        return full
    if logits.shape[0] > vocab_size:
        return logits[:vocab_size]
    if logits.shape[0] < vocab_size:
        return torch.cat([logits, torch.full((vocab_size - logits.shape[0],), float("-inf"))])
    return logits


class TorchLM:
    """A Hugging Face causal LM with a DynamicCache (what `ModelDrafter` always ran before)."""

    def __init__(self, loaded: LoadedModel, vocab_size: int) -> None:
        self.loaded = loaded
        self.vocab_size = vocab_size
        self.cache = DynamicCache(config=loaded.model.config)
        self.cached: list[int] = []  # the tokens whose KV is in the cache
        self.head_ids = None if loaded.head_ids is None else loaded.head_ids.cpu()

    @torch.inference_mode()
    def advance(self, context: list[int]) -> torch.Tensor:
        """See DraftLM.advance."""
        keep = reusable_prefix(self.cached, context)
        if keep < len(self.cached):
            truncate_cache(self.cache, keep)
            del self.cached[keep:]
        return self.feed(context[keep:])

    @torch.inference_mode()
    def feed(self, ids: list[int]) -> torch.Tensor:
        """See DraftLM.feed."""
        tensor = torch.tensor([ids], dtype=torch.long, device=self.loaded.device)
        out = self.loaded.model(input_ids=tensor, past_key_values=self.cache, use_cache=True)
        self.cached.extend(ids)
        return to_vocab(out.logits[0, -1], self.head_ids, self.vocab_size)
