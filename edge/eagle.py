"""Drafting with an EAGLE head (common/models/eagle.py) from the target's own features.

The verifier sends the target's final hidden states for every committed position but the newest
(docs/eagle.md); `FeatureLog` keeps them. To draft after a context of L tokens the head needs, at
each position i, the feature before it: positions whose feature is in the log are fed true features
(in one batch, reusing the head's cache where it still matches), the rest — the tokens of a block
still being verified when drafting ahead, or what was drafted offline — are bridged with the head's
own predictions, and so is every token it drafts. With no features at all, or a context that runs
more than `MAX_BRIDGED` tokens past them, the fallback drafter (the plain drafter, or n-gram) drafts
instead and `notice` says so once.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from ..common.maths.features import decode_features
from ..common.models.loading import LoadedModel, truncate_cache
from ..common.protocol.wire import FeatureBlock
from .drafter import ModelDrafter
from .proposal import DraftSettings, Drafter, Interrupt, Proposal

MAX_BRIDGED = 32  # tokens past the last true feature the head bridges with its own predictions


class FeatureLog:
    """The target's features for a session's committed positions 0..count-1, as replies bring them."""

    def __init__(self) -> None:
        self._rows = torch.empty(0)
        self.count = 0
        self.received_bytes = 0

    def add(self, block: FeatureBlock) -> None:
        """Take a reply's features; a block starting before the end replaces what follows its start
        (a re-opened session sends its whole context again). A gap means something was lost: the
        log keeps only what is contiguous."""
        block.validate()
        self.received_bytes += block.nbytes
        if block.start > self.count:
            return
        rows = decode_features(block)
        end = block.start + block.count
        if self._rows.shape[0] < end or self._rows.shape[1:] != rows.shape[1:]:
            grown = torch.zeros(max(end, 2 * self._rows.shape[0]), rows.shape[1])
            if self._rows.shape[1:] == rows.shape[1:]:
                grown[: self.count] = self._rows[: self.count]
            self._rows = grown
        self._rows[block.start:end] = rows
        self.count = end

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Features of positions [start, end)."""
        return self._rows[start:end]


class EagleDrafter(ModelDrafter):
    """An EAGLE head behind the drafter interface: same drafting loop, same q, same fallback test."""

    def __init__(self, loaded: LoadedModel, settings: DraftSettings, log: FeatureLog, fallback: Drafter) -> None:
        super().__init__(loaded, settings)
        self.head = loaded.model
        self._cache = DynamicCache(config=loaded.model.config)  # the head's own: it drafts without self.lm
        self.log = log
        self.fallback = fallback
        self.notice = ""  # set when the fallback drafter takes over (or hands back); read and cleared by the caller
        self._using_fallback = False
        self._tokens: list[int] = []  # the token at each head position 1..m (position i's input is (f_{i-1}, t_i))
        self._out: list[torch.Tensor] = []  # the head's output (predicted feature) at each position
        self._true = 0  # leading positions fed with true features (the rest get cut before reuse)
        self._known = 0  # true features usable for the context being drafted after (set by propose)

    def propose(self, context: list[int], max_tokens: int, *, interrupt: Interrupt | None = None,
                fallback: bool = True) -> Proposal:
        """Draft from features when they reach close enough to the context's end, else with the fallback."""
        known = min(self.log.count, len(context) - 1)
        usable = known > 0 and len(context) - 1 - known <= MAX_BRIDGED
        if usable == self._using_fallback:
            self._using_fallback = not usable
            self.notice = ("the eagle drafter has the target's features again" if usable else
                           f"no target features for the last {len(context) - 1 - known} tokens: "
                           f"drafting with the {type(self.fallback).__name__} until they come")
        if not usable:
            return self.fallback.propose(context, max_tokens, interrupt=interrupt, fallback=fallback)
        self._known = known
        return super().propose(context, max_tokens, interrupt=interrupt, fallback=fallback)

    @torch.inference_mode()
    def _advance(self, tokens: list[int]) -> torch.Tensor:
        """Bring the head to `tokens` (true features up to `self._known`, bridged after); logits after it."""
        known = self._known
        # 1. Keep the cached positions fed with true features whose tokens still match.
        keep, limit = 0, min(self._true, known, len(tokens) - 1)
        while keep < limit and self._tokens[keep] == tokens[keep + 1]:
            keep += 1
        truncate_cache(self._cache, keep)
        del self._tokens[keep:], self._out[keep:]
        self._true = keep
        # 2. Feed the positions whose feature is now known, in one batch.
        if known > keep:
            self._run(self.log.rows(keep, known), tokens[keep + 1: known + 1])
            self._true = known
        # 3. Bridge the rest with the head's own features, one position at a time.
        for i in range(known + 1, len(tokens)):
            self._run(self._out[-1][None], [tokens[i]])
        return self._to_vocab(self.head.logits(self._out[-1]).float())

    @torch.inference_mode()
    def _feed(self, feed: list[int]) -> torch.Tensor:
        """A drafted token, fed with the head's own feature before it."""
        self._run(self._out[-1][None], feed)
        return self._to_vocab(self.head.logits(self._out[-1]).float())

    def _run(self, features: torch.Tensor, tokens: list[int]) -> None:
        first = len(self._tokens) + 1
        positions = torch.arange(first, first + len(tokens), device=self.head.device)[None]
        out = self.head(features[None].to(self.head.device), torch.tensor([tokens], device=self.head.device),
                        positions, cache=self._cache)
        self._tokens += tokens
        self._out += list(out[0])
