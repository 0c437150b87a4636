"""The sampling transform both sides apply before any comparison of distributions.

The speculative rules are only exact when the drafter's q and the target's p come out of the very
same transform, so this module is the single place that defines it.
"""
from __future__ import annotations

import torch

from .wire import SamplingParams

__all__ = ["SamplingParams", "logits_to_probs", "round_generator", "sample"]


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p, and return float32 probabilities.

    logits: [..., V]. Returns [..., V], rows summing to 1. At temperature 0 no truncation is
    applied and the temperature is 1: that is the distribution BiLD's confidence tests read,
    while the tokens themselves are argmax.
    """
    x = logits.float()
    if params.greedy:
        return torch.softmax(x, dim=-1)
    x = x / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p; the first token
        # always survives.
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a 1-D distribution (need not be normalised)."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def round_generator(seed: int, round_index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded by (session seed, round), so a replayed or re-opened round draws the same numbers."""
    gen = torch.Generator(device=device)
    # A fixed odd multiplier spreads rounds apart; the mask keeps the seed a valid uint64.
    gen.manual_seed((seed * 0x9E3779B97F4A7C15 + round_index) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen
