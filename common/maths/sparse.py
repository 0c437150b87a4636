"""Exact sparse form of the drafter's distribution q, as it crosses the wire.

The edge truncates q (top `max_support` tokens, then renormalises) *before* sampling and samples
from the truncated q; it sends that same q. The verifier therefore sees the exact distribution the
draft came from, so the sparse format costs no exactness (docs/design.md §2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import gumbel_max


@dataclass(frozen=True)
class SparseDist:
    """A distribution over a vocabulary stored as its support."""

    ids: torch.Tensor  # [S] int64, distinct token ids
    probs: torch.Tensor  # [S] float32, > 0, summing to 1

    def sample(self, generator: torch.Generator | None) -> int:
        """Draw a token id from exactly this distribution."""
        return int(self.ids[torch.multinomial(self.probs, 1, generator=generator)].item())

    def coupled(self, seed: int, position: int) -> int:
        """The token the coupled rule draws from this distribution at `position` (sampling.gumbel_max)."""
        return gumbel_max(self.ids, self.probs, seed, position)


def truncate(probs: torch.Tensor, max_support: int) -> SparseDist:
    """Keep the `max_support` most likely tokens with non-zero mass and renormalise.

    probs: [V] float32. max_support 0 keeps the whole non-zero support.
    """
    nz = torch.nonzero(probs > 0, as_tuple=True)[0]
    vals = probs[nz]
    if max_support and nz.numel() > max_support:
        vals, pos = torch.topk(vals, max_support)
        nz = nz[pos]
    vals = vals.float()
    return SparseDist(ids=nz.long(), probs=vals / vals.sum())
