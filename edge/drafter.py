"""Drafters: propose a block of tokens and the exact q each was sampled from; observe the verdict.

Three kinds: `ModelDrafter`, a small causal LM whose KV cache lives across rounds (its logits from
torch or llama.cpp: edge/draft_lm.py); `EagleDrafter` (edge/eagle.py), a head drafting from the
target's own features; and `NgramDrafter` (prompt lookup), which copies what followed the latest
earlier occurrence of the context's last n-gram and needs no model. `make_drafter` (edge/drafters.py)
builds one per generation with every setting fixed (sampling, α_FB, stop ids, what to do with a
low-confidence token: `DraftSettings`); the generation drafts the next block with it while the
current one is verified (edge/generation.py, a round's step 4). A proposal's `dists` is None at
temperature 0, where q is one-hot.
"""
from __future__ import annotations

import torch

from ..common.maths.bild import should_fall_back
from ..common.models.loading import LoadedModel
from ..common.maths.sampling import logits_to_probs, penalize, round_generator
from ..common.maths.sparse import SparseDist, truncate
from ..common.protocol.wire import SamplingParams
from .draft_lm import DraftLM, TorchLM, to_vocab
from .estimates import RANKS
from .proposal import DraftSettings, Drafting, Interrupt, Proposal


def ranked_choices(probs: torch.Tensor, first: int | None = None) -> tuple[int, ...]:
    """The drafter's RANKS choices at a node, in the order a tree takes them as children: the likeliest
    first; in coupled mode `first`, the coupled draw (the chain's token, a tree's first child), then the
    likeliest others. Ranking the target's token in this order makes ρ_1 the first child's acceptance."""
    top = torch.topk(probs, RANKS + 1).indices.tolist()
    if first is None:
        return tuple(top[:RANKS])
    return (first, *[t for t in top if t != first][:RANKS - 1])


class ModelDrafter:
    """A small causal LM with a KV cache kept across rounds and matched to each new context. What it
    decides (sampling, the BiLD fallback, stop ids, the q it sends) is here; the logits come from its
    `DraftLM` (edge/draft_lm.py): torch by default, or llama.cpp (edge/llamacpp_lm.py)."""

    def __init__(self, loaded: LoadedModel, settings: DraftSettings, lm: DraftLM | None = None) -> None:
        self.loaded = loaded
        self.settings = settings
        self.sampling = settings.sampling
        self.generator = None if self.sampling.greedy or settings.coupled else round_generator(settings.seed, -1)
        self._prompt_len = settings.prompt_len  # 0 until the first proposal says where the prompt ends
        self.lm: DraftLM = lm if lm is not None else TorchLM(loaded, settings.vocab_size)
        self._head_ids = None if loaded.head_ids is None else loaded.head_ids.cpu()

    def propose(self, context: list[int], max_tokens: int, *, interrupt: Interrupt | None = None,
                fallback: bool = True) -> Proposal:
        """Draft up to `max_tokens`, ending at low confidence (max q < α_FB), a stop id or an interrupt."""
        s = self.settings
        self._prompt_len = self._prompt_len or len(context)
        threshold = s.drafting.fallback_threshold if fallback else 0.0
        ids: list[int] = []
        dists: list[SparseDist] = []
        ranked: list[tuple[int, ...]] = []
        fell_back = False
        logits = None
        while len(ids) < max_tokens and not (interrupt is not None and interrupt()):
            # The cache is brought to the context once; each drafted token is then fed alone.
            logits = self._advance(context) if logits is None else self._feed([ids[-1]])
            penalized = penalize(logits[None], self.sampling, context + ids, self._prompt_len)[0]
            probs = logits_to_probs(penalized, self.sampling)
            if should_fall_back(probs, threshold):
                fell_back = True
                if not s.drafting.keep_low_confidence:
                    break
            if self.sampling.greedy:
                token = int(probs.argmax().item())
            else:
                dist = truncate(probs, s.drafting.wire_top_k)
                # Coupled: the noise of this token's absolute position, as the verifier draws its own.
                token = dist.coupled(s.seed, len(context) + len(ids)) if s.coupled else dist.sample(self.generator)
                dists.append(dist)
            ranked.append(ranked_choices(probs, token if s.coupled else None))
            ids.append(token)
            if fell_back or token in s.stop_ids:
                break
        return Proposal(ids, None if self.sampling.greedy else dists, fell_back, ranked=ranked[:len(ids)])

    def observe(self, accepted: list[int], token: int) -> None:
        """Nothing to do now: the next `propose` keeps the cached prefix it shares with the new
        context, which also keeps the work of a block drafted ahead when its guess came true."""

    def _advance(self, tokens: list[int]) -> torch.Tensor:
        """Make the cache hold `tokens`, reusing the longest cached prefix; the float32 CPU logits [V]
        for the position after them."""
        return self.lm.advance(tokens)

    def _feed(self, feed: list[int]) -> torch.Tensor:
        """Append `feed` to the cache; the float32 CPU logits [V] for the position after it."""
        return self.lm.feed(feed)

    def _to_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafter's logits as float32 CPU logits over the target's vocabulary."""
        return to_vocab(logits, self._head_ids, self.settings.vocab_size)


class NgramDrafter:
    """Prompt lookup: after the latest earlier occurrence of the context's last n tokens, copy what
    followed (longest n first). q is one-hot on the copied token, which keeps sampling exact too."""

    def __init__(self, sampling: SamplingParams, max_ngram: int = Drafting.ngram_max, min_ngram: int = 1,
                 stop_ids: frozenset[int] = frozenset()) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.sampling = sampling
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.stop_ids = stop_ids

    def propose(self, context: list[int], max_tokens: int, *, interrupt: Interrupt | None = None,
                fallback: bool = True) -> Proposal:
        """The copied continuation (empty when no n-gram repeats); fallback does not apply."""
        ids = self._lookup(context, max_tokens)
        for i, token in enumerate(ids):
            if token in self.stop_ids:
                ids = ids[: i + 1]
                break
        dists = None if self.sampling.greedy else [
            SparseDist(torch.tensor([t]), torch.tensor([1.0])) for t in ids]
        return Proposal(ids, dists, False)

    def observe(self, accepted: list[int], token: int) -> None:
        """Prompt lookup learns nothing from a verdict."""

    def _lookup(self, context: list[int], max_tokens: int) -> list[int]:
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            suffix = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start: start + n] == suffix:
                    return context[start + n: start + n + max_tokens]
        return []
