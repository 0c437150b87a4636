"""Drafters: propose a block of tokens and the exact q each was sampled from.

Two kinds: `ModelDrafter`, a small causal LM whose KV cache lives across rounds, and `NgramDrafter`
(prompt lookup), which copies what followed the latest earlier occurrence of the context's last
n-gram and needs no model. A proposal's `dists` is None at temperature 0, where q is one-hot.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from ..common.bild import should_fall_back
from ..common.models import LoadedModel, truncate_cache
from ..common.sampling import logits_to_probs
from ..common.sparse import SparseDist, truncate
from ..common.wire import DraftBlock, SamplingParams


@dataclass(frozen=True)
class Proposal:
    """A draft block."""

    ids: list[int]
    dists: list[SparseDist] | None  # the q each token was sampled from; None at temperature 0
    fell_back: bool  # the block ended because the drafter's confidence dropped below α_FB

    def block(self, session_id: str, round_index: int, committed_len: int, with_probs: bool) -> DraftBlock:
        """This proposal as a verify request; with_probs: send q (the modes that read it)."""
        dists = self.dists if with_probs else None
        return DraftBlock(session_id=session_id, round=round_index, committed_len=committed_len,
                          draft_ids=tuple(self.ids),
                          support_ids=tuple(tuple(d.ids.tolist()) for d in dists or ()),
                          probs=tuple(tuple(d.probs.tolist()) for d in dists or ()))

    def tail(self, start: int) -> Proposal:
        """The proposal without its first `start` tokens."""
        return Proposal(self.ids[start:], None if self.dists is None else self.dists[start:], self.fell_back)


class Drafter(Protocol):
    """Anything that can propose the next tokens after a committed context."""

    def propose(self, context: list[int], max_tokens: int, fallback_threshold: float, stop_ids: frozenset[int],
                interrupt: Callable[[], bool] | None = None) -> Proposal:
        """Draft up to `max_tokens` tokens after `context`; stop early when `interrupt()` turns true."""
        ...


class ModelDrafter:
    """A small causal LM with a KV cache kept across rounds and cropped to what was accepted."""

    def __init__(self, loaded: LoadedModel, sampling: SamplingParams, vocab_size: int, wire_top_k: int,
                 generator: torch.Generator | None, keep_low_confidence: bool = True) -> None:
        """vocab_size: the target's; drafter logits are cut or padded to it so ids always agree.

        keep_low_confidence: when the BiLD fallback ends a block, keep the token that triggered it
        (as Hugging Face assisted generation does: the verifier scores it at almost no cost) or
        drop it (as BiLD does: the small model never emits a token it is unsure of).
        """
        self.loaded = loaded
        self.sampling = sampling
        self.vocab_size = vocab_size
        self.wire_top_k = wire_top_k
        self.generator = generator
        self.keep_low_confidence = keep_low_confidence
        self._cache = DynamicCache(config=loaded.model.config)
        self._cached: list[int] = []  # the tokens whose KV is in the cache
        self._head_ids = None if loaded.head_ids is None else loaded.head_ids.cpu()

    def propose(self, context: list[int], max_tokens: int, fallback_threshold: float, stop_ids: frozenset[int],
                interrupt: Callable[[], bool] | None = None) -> Proposal:
        """Draft up to `max_tokens`, ending at low confidence (max q < α_FB), a stop id or an interrupt."""
        ids: list[int] = []
        dists: list[SparseDist] = []
        fell_back = False
        logits = None
        while len(ids) < max_tokens and not (interrupt is not None and interrupt()):
            # The cache is brought to the context once; each drafted token is then fed alone.
            logits = self._advance(context) if logits is None else self._feed([ids[-1]])
            probs = logits_to_probs(logits, self.sampling)
            if should_fall_back(probs, fallback_threshold):
                fell_back = True
                if not self.keep_low_confidence:
                    break
            if self.sampling.greedy:
                token = int(probs.argmax().item())
            else:
                dist = truncate(probs, self.wire_top_k)
                token = dist.sample(self.generator)
                dists.append(dist)
            ids.append(token)
            if fell_back or token in stop_ids:
                break
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
        return self._feed(tokens[keep:])

    @torch.inference_mode()
    def _feed(self, feed: list[int]) -> torch.Tensor:
        """Append `feed` to the cache; the float32 CPU logits [V] for the position after it."""
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


class NgramDrafter:
    """Prompt lookup: after the latest earlier occurrence of the context's last n tokens, copy what
    followed (longest n first). q is one-hot on the copied token, which keeps sampling exact too."""

    def __init__(self, sampling: SamplingParams, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.sampling = sampling
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, context: list[int], max_tokens: int, fallback_threshold: float, stop_ids: frozenset[int],
                interrupt: Callable[[], bool] | None = None) -> Proposal:
        """The copied continuation (empty when no n-gram repeats); fallback does not apply."""
        ids = self._lookup(context, max_tokens)
        for i, token in enumerate(ids):
            if token in stop_ids:
                ids = ids[: i + 1]
                break
        dists = None if self.sampling.greedy else [
            SparseDist(torch.tensor([t]), torch.tensor([1.0])) for t in ids]
        return Proposal(ids, dists, False)

    def _lookup(self, context: list[int], max_tokens: int) -> list[int]:
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            suffix = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start: start + n] == suffix:
                    return context[start + n: start + n + max_tokens]
        return []
