"""Drafters: propose a block of tokens and the exact q each was sampled from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from ..common.bild import should_fall_back
from ..common.models import LoadedModel, truncate_cache
from ..common.sampling import logits_to_probs
from ..common.sparse import SparseDist, truncate
from ..common.wire import SamplingParams


@dataclass(frozen=True)
class Proposal:
    """A draft block. `dists` is None at temperature 0 (q is one-hot)."""

    ids: list[int]
    dists: list[SparseDist] | None
    fell_back: bool  # the block ended because confidence dropped below α_FB


class Drafter(Protocol):
    """Anything that can propose the next tokens after a committed context."""

    def propose(self, context: list[int], max_tokens: int, fallback_threshold: float,
                stop_ids: frozenset[int]) -> Proposal:
        """Draft up to `max_tokens` tokens after `context`."""
        ...


class ModelDrafter:
    """A small causal LM with a KV cache kept across rounds and cropped to what was accepted."""

    def __init__(self, loaded: LoadedModel, sampling: SamplingParams, vocab_size: int,
                 wire_top_k: int, generator: torch.Generator | None) -> None:
        """vocab_size: the target's; drafter logits are cut or padded to it so ids always agree."""
        self.loaded = loaded
        self.sampling = sampling
        self.vocab_size = vocab_size
        self.wire_top_k = wire_top_k
        self.generator = generator
        self._cache = DynamicCache(config=loaded.model.config)
        self._cached: list[int] = []  # the tokens whose KV is in the cache
        self._head_ids = None if loaded.head_ids is None else loaded.head_ids.cpu()

    def propose(self, context: list[int], max_tokens: int, fallback_threshold: float,
                stop_ids: frozenset[int]) -> Proposal:
        """Draft up to `max_tokens`, ending after a token drafted with max q < α_FB or a stop id.

        The low-confidence token is kept in the block (as Hugging Face assisted generation does):
        the verifier scores it in the same pass at almost no cost, and it is often right.
        """
        if max_tokens == 0:
            return Proposal([], None if self.sampling.greedy else [], False)
        logits = self._advance(context)
        ids: list[int] = []
        dists: list[SparseDist] = []
        fell_back = False
        while True:
            probs = logits_to_probs(logits, self.sampling)
            if self.sampling.greedy:
                token = int(logits.argmax().item())
            else:
                dist = truncate(probs, self.wire_top_k)
                token = dist.sample(self.generator)
                dists.append(dist)
            ids.append(token)
            fell_back = should_fall_back(probs, fallback_threshold)
            if fell_back or token in stop_ids or len(ids) == max_tokens:
                break
            logits = self._advance(context + ids)
        return Proposal(ids, None if self.sampling.greedy else dists, fell_back)

    @torch.inference_mode()
    def _advance(self, tokens: list[int]) -> torch.Tensor:
        """Make the cache hold tokens[:-1] plus the last token, reusing the longest cached prefix;
        return the float32 CPU logits [V] for the position after `tokens`."""
        keep = 0
        limit = min(len(self._cached), len(tokens) - 1)
        while keep < limit and self._cached[keep] == tokens[keep]:
            keep += 1
        if keep < len(self._cached):
            truncate_cache(self._cache, keep)
            del self._cached[keep:]
        feed = tokens[keep:]
        ids = torch.tensor([feed], dtype=torch.long, device=self.loaded.device)
        out = self.loaded.model(input_ids=ids, past_key_values=self._cache, use_cache=True)
        self._cached.extend(feed)
        logits = out.logits[0, -1].float().cpu()
        if self._head_ids is not None:
            # A compact drafter predicts over a subset of the vocabulary; the rest gets no mass.
            full = torch.full((self.vocab_size,), float("-inf"))
            full[self._head_ids] = logits
            return full
        if logits.shape[0] > self.vocab_size:
            logits = logits[: self.vocab_size]
        elif logits.shape[0] < self.vocab_size:
            pad = torch.full((self.vocab_size - logits.shape[0],), float("-inf"))
            logits = torch.cat([logits, pad])
        return logits
