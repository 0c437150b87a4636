"""The language-model half of a drafter: logits after a context, with a KV cache kept across calls.

`ModelDrafter` (edge/drafter.py) owns what a drafter decides — sampling, the BiLD fallback, stop ids,
the exact q it sends — and asks a `DraftLM` only for logits over the target's whole vocabulary, so the
same decisions run over either implementation: `TorchLM` here (a Hugging Face model and its
DynamicCache: GPUs, EAGLE heads' fallbacks, and the reference), or `LlamaCppLM`
(edge/llamacpp_lm.py: the drafter's converted GGUF in llama.cpp's CPU kernels).

Besides a chain, a DraftLM scores draft-tree nodes (edge/tree_draft.py): `feed_tree` puts nodes after
the context, each attending to the context, its ancestors and itself only, and keeps them until the
next `advance` or `feed`, so the cache always comes back to the context.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from transformers import DynamicCache

from ..common.models.loading import LoadedModel, truncate_cache
from ..common.protocol.tree import ROOT, is_chain


class DraftLM(Protocol):
    """A drafter LM behind a cache: every call returns float32 CPU logits over the target's vocabulary
    (ids the drafter cannot predict get -inf), [V] after a chain or [n, V] for n tree nodes."""

    def advance(self, context: list[int]) -> torch.Tensor:
        """Make the cache hold `context`, reusing the longest cached prefix (at least the last token
        is fed again, for its logits) and cutting the rest, tree nodes included."""
        ...

    def feed(self, ids: list[int]) -> torch.Tensor:
        """Append `ids` to the cached context (dropping any tree nodes first)."""
        ...

    def feed_tree(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Score draft-tree nodes after the cached context in one pass: [len(tokens), V], row i after
        node i. parents[i] is -1 (a child of the context's last token) or the index of an earlier node
        among all the tree nodes fed since the last advance or feed (those of earlier calls first).
        A node of depth d sits at position len(context) + d − 1 and attends to the context, its
        ancestors and itself only. The nodes stay cached, for later calls to hang nodes from them."""
        ...


class TreeNodes:
    """The draft-tree nodes an LM holds after its context: parents and depths, checked as they come."""

    def __init__(self) -> None:
        self.parents: list[int] = []
        self.depths: list[int] = []

    def __len__(self) -> int:
        return len(self.parents)

    def add(self, tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
        """Record new nodes; their depths. ValueError (nothing recorded) for a parent that is not
        -1 or an earlier node."""
        if len(tokens) != len(parents) or not tokens:
            raise ValueError(f"feed_tree needs one parent per token and at least one token, got "
                             f"{len(tokens)} tokens and {len(parents)} parents")
        start = len(self.parents)
        for i, p in enumerate(parents, start):
            if not ROOT <= p < i:
                raise ValueError(f"tree node {i} has parent {p}: it must be -1 or an earlier node")
        for p in parents:
            self.parents.append(p)
            self.depths.append(1 if p == ROOT else self.depths[p] + 1)
        return self.depths[start:]

    def ancestry(self, node: int) -> list[int]:
        """`node` and its ancestors among the tree nodes (not the context)."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return out

    def clear(self) -> None:
        """Forget every node."""
        self.parents.clear()
        self.depths.clear()


def reusable_prefix(cached: list[int], context: list[int]) -> int:
    """How many leading cached tokens `context` keeps; never all of it, since the last token must be
    fed to get the logits after it."""
    keep, limit = 0, min(len(cached), len(context) - 1)
    while keep < limit and cached[keep] == context[keep]:
        keep += 1
    return keep


def to_vocab(logits: torch.Tensor, head_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """A drafter's head logits ([..., head rows]) as float32 CPU logits over the target's vocabulary."""
    logits = logits.float().cpu()
    if head_ids is not None:
        # A compact drafter predicts over a subset of the vocabulary; the rest gets no mass.
        full = torch.full((*logits.shape[:-1], vocab_size), float("-inf"))
        full[..., head_ids] = logits
        return full
    if logits.shape[-1] > vocab_size:
        return logits[..., :vocab_size]
    if logits.shape[-1] < vocab_size:
        pad = torch.full((*logits.shape[:-1], vocab_size - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
    return logits


class TorchLM:
    """A Hugging Face causal LM with a DynamicCache (what `ModelDrafter` always ran before).

    Tree nodes go into the same cache after the context, in the order they are fed, with explicit
    position ids and a 4-D additive attention mask (0 where a node may look, the dtype's minimum
    elsewhere): transformers 5.x passes a 4-D mask to the attention as it is, and an additive one
    means the same to the sdpa and the eager kernels (a boolean one would be added as 0/1 by eager)."""

    def __init__(self, loaded: LoadedModel, vocab_size: int) -> None:
        self.loaded = loaded
        self.vocab_size = vocab_size
        self.cache = DynamicCache(config=loaded.model.config)
        self.cached: list[int] = []  # the context's tokens whose KV is in the cache (tree nodes follow them)
        self.tree = TreeNodes()
        self.head_ids = None if loaded.head_ids is None else loaded.head_ids.cpu()

    @torch.inference_mode()
    def advance(self, context: list[int]) -> torch.Tensor:
        """See DraftLM.advance."""
        self._drop_tree()
        keep = reusable_prefix(self.cached, context)
        if keep < len(self.cached):
            truncate_cache(self.cache, keep)
            del self.cached[keep:]
        return self.feed(context[keep:])

    @torch.inference_mode()
    def feed(self, ids: list[int]) -> torch.Tensor:
        """See DraftLM.feed."""
        self._drop_tree()
        tensor = torch.tensor([ids], dtype=torch.long, device=self.loaded.device)
        out = self.loaded.model(input_ids=tensor, past_key_values=self.cache, use_cache=True)
        self.cached.extend(ids)
        return to_vocab(out.logits[0, -1], self.head_ids, self.vocab_size)

    @torch.inference_mode()
    def feed_tree(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """See DraftLM.feed_tree."""
        start = len(self.tree)
        depths = self.tree.add(tokens, parents)
        context, device = len(self.cached), self.loaded.device
        model = self.loaded.model
        mask = None
        # A chain needs no mask of its own: the model's causal one is the same, and the pass is then
        # exactly `feed`'s (a top-1 tree drafts the chain's very logits).
        if not is_chain(self.tree.parents):
            mask = torch.full((len(tokens), context + len(self.tree)), torch.finfo(model.dtype).min,
                              dtype=model.dtype, device=device)
            mask[:, :context] = 0
            for row in range(len(tokens)):
                mask[row, [context + a for a in self.tree.ancestry(start + row)]] = 0
            mask = mask[None, None]
        positions = torch.tensor([[context + d - 1 for d in depths]], device=device)
        try:
            out = model(input_ids=torch.tensor([tokens], device=device), position_ids=positions,
                        attention_mask=mask, past_key_values=self.cache, use_cache=True)
        except BaseException:
            # The cache may hold some layers' keys of this pass: back to the context.
            self._drop_tree()
            raise
        return to_vocab(out.logits[0], self.head_ids, self.vocab_size)

    def _drop_tree(self) -> None:
        """Cut the tree nodes from the cache: it holds the context again."""
        if self.cache.get_seq_length() > len(self.cached):
            truncate_cache(self.cache, len(self.cached))
        self.tree.clear()
