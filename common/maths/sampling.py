"""The sampling transform both sides apply before any comparison of distributions, and the
randomness the rules draw.

The transform is `penalize` (repetition, frequency and presence penalties on the logits), then
`logits_to_probs` (temperature, top-k, top-p). The target's p must come out of exactly this transform
wherever it is computed (verify rounds, cloud-only decoding), and the drafter applies the same one so
that its q is close to p; this module is the single place that defines it (docs/design.md §2.1).

Randomness: the rejection-sampling rules draw from a generator per (seed, round); coupled sampling
uses Gumbel noise that is a pure function of (seed, position, token) (docs/design.md §2.2).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..protocol.wire import SamplingParams

__all__ = ["SamplingParams", "gumbel_max", "gumbel_noise", "gumbel_scores", "logits_to_probs", "penalize",
           "round_generator", "sample"]

_FLOAT32_MAX = torch.finfo(torch.float32).max
_U64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: 2^64 / golden ratio, odd
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finaliser multipliers


def penalize(logits: torch.Tensor, params: SamplingParams, context: Sequence[int], prompt_len: int,
             block: Sequence[int] = ()) -> torch.Tensor:
    """Apply the repetition, frequency and presence penalties to rows of logits.

    logits: [n, V], n <= len(block) + 1; row j scores the position after context + block[:j] (a
    verify pass scores γ+1 positions whose histories grow by one draft token each). context[:prompt_len]
    is the prompt. Every token of a row's history counts for the repetition penalty (HF/vLLM: a logit
    l becomes l / r if l > 0, else l·r); only the tokens after the prompt count for the frequency and
    presence penalties (OpenAI: l −= f·count + p·[count > 0]). Returns float32 [n, V] on the logits'
    device; with every penalty neutral, `logits` itself, so nothing changes, not even a bit.

    A repetition penalty close to 0 divides a positive logit past float32's range; such a logit is
    held at float32's largest value instead of +inf (which softmax would turn into NaN), so every
    accepted setting gives finite logits for finite ones: the tokens it favours share the mass.
    """
    if not params.penalized:
        return logits
    rows, vocab = logits.shape
    assert rows <= len(block) + 1, f"{rows} rows of logits need a block of at least {rows - 1} tokens"
    device = logits.device
    ctx = torch.as_tensor(list(context), dtype=torch.long, device=device)
    # added[j]: the block tokens row j has seen on top of the context, counted per token id.
    added = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
    if rows > 1:
        ids = torch.as_tensor(list(block[:rows - 1]), dtype=torch.long, device=device)
        added[torch.arange(1, rows, device=device), ids] = 1.0
        added = added.cumsum(0)
    x = logits.float()
    if params.repetition_penalty != 1.0:
        seen = (torch.bincount(ctx, minlength=vocab)[:vocab] > 0) | (added > 0)
        x = torch.where(seen, torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty), x)
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        counts = torch.bincount(ctx[prompt_len:], minlength=vocab)[:vocab].float() + added
        x = x - (params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float())
    return x.clamp(max=_FLOAT32_MAX)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p, and return float32 probabilities.

    logits: [..., V], finite or −inf (NaN stays NaN). Returns [..., V], rows summing to 1. At
    temperature 0 no truncation is applied and the temperature is 1: that is the distribution BiLD's
    confidence tests read, while the tokens themselves are argmax.

    Each row is shifted to a maximum of 0 before dividing by the temperature (softmax does not
    change under a shift): a small temperature can then only push logits down to −inf, never up to
    +inf, and every row keeps one token of mass > 0.
    """
    x = logits.float()
    if params.greedy:
        return torch.softmax(x, dim=-1)
    x = (x - x.amax(dim=-1, keepdim=True)) / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p. The first token
        # always survives, also when top_p is below float32's smallest value and compares as 0.
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False
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
    gen.manual_seed((seed * _GOLDEN + round_index) & _U64)
    return gen


# ---- coupled sampling: Gumbel noise as a pure function of (seed, position, token) ------------------

def _signed(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    c &= _U64
    return c - (1 << 64) if c >> 63 else c


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic: it would copy the sign bit in)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, a bijection on 64-bit words; int64 products wrap modulo 2^64 like uint64."""
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def gumbel_noise(seed: int, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise G(seed, t, v) for every position t in `positions` [n] and token v in
    `token_ids` [m]: float64 [n, m] on the CPU.

    Each value is a pure function of (seed, t, v) — a counter-based hash (splitmix64 steps) turned into
    a uniform u in (0, 1) and then into −log(−log u) — so it does not depend on the vocabulary size,
    the device, which tokens are asked for, γ or the round: drafter, verifier and cloud-only decoding
    all see the same noise for a position.
    """
    key = _mix(torch.tensor([_signed(seed)]))  # seeds differing in any bit give unrelated keys
    t = positions.to("cpu", torch.long)[:, None]
    v = token_ids.to("cpu", torch.long)[None, :]
    z = _mix(_mix(key + t * _signed(_GOLDEN)) + v * _signed(_GOLDEN))
    u = (_shr(z, 11).double() + 0.5) * 2.0 ** -53  # the top 53 bits, centred: strictly inside (0, 1)
    return -torch.log(-torch.log(u))


def gumbel_scores(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """log probs + noise in float64: with Gumbel noise their argmax over the last dimension is a sample
    from `probs` (the Gumbel-max trick); tokens with probability 0 score −inf and are never chosen."""
    return torch.log(probs.double()) + noise


def gumbel_max(token_ids: torch.Tensor, probs: torch.Tensor, seed: int, position: int) -> int:
    """The coupled draw at `position`: argmax over v of log probs(v) + G(seed, position, v).

    token_ids [m] and probs [m] give a distribution by its support (a sparse q, or the non-zero part of
    p): tokens outside it could never win, so their noise is not computed, and the noise of the tokens
    in it does not depend on which others are there. Drafter and verifier both draw with this.
    """
    noise = gumbel_noise(seed, torch.tensor([position]), token_ids)[0]
    return int(token_ids[gumbel_scores(probs, noise).argmax()].item())
