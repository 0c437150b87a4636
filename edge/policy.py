"""How long a block to draft, and whether to draft at all: pure functions of measured rates.

Symbols (docs/design.md §2), all times in seconds:
    α_j     probability that draft position j is accepted given positions 1..j-1 were
    t_d     the drafter's time per drafted token
    rtt     network round trip of one verify call (what is not the verifier's own time)
    t_v(γ)  the verifier's time for a block of γ drafts (one forward over γ+1 positions)
    T       the cloud's time per token when it decodes alone (cloud-only streaming hides rtt)

A round drafting γ tokens commits E(γ) = 1 + Σ_{j≤γ} Π_{i≤j} α_i tokens on average and costs
γ·t_d + rtt + t_v(γ); pipelined drafting hides the drafting of the next block behind the wait
whenever the whole block and the guessed bonus token were right. Hybrid decoding is worth it only
while its best rate beats cloud-only's 1/T.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Rates:
    """What the edge currently believes about the link, the drafter and the verifier."""

    alphas: Sequence[float]  # α_1, α_2, ...: per-position acceptance (at least max_gamma + 1 entries)
    draft_s: float  # t_d
    rtt_s: float  # rtt
    verify_single_s: float  # t_v(0): the verifier scoring one position (an empty block)
    verify_block_s: float  # for γ ≥ 1, t_v(γ) = verify_block_s + verify_per_draft_s · γ
    verify_per_draft_s: float
    cloud_token_s: float  # T
    # t_v(0), t_v(1), ...: from the cloud's measured pass costs when it reported them; overrides the
    # line above for every γ it covers (a CPU's t_v is far from linear in γ).
    verify_curve_s: Sequence[float] = ()
    tree_node_s: float = 0.0  # drafting time per node of a draft tree (0: not measured, taken as draft_s)

    def verify_s(self, gamma: int) -> float:
        """t_v(γ)."""
        if gamma < len(self.verify_curve_s):
            return self.verify_curve_s[gamma]
        return self.verify_single_s if gamma == 0 else self.verify_block_s + self.verify_per_draft_s * gamma

    def optimistic(self, alpha: float) -> Rates:
        """The same rates with every α_j raised to at least `alpha` (what a good drafter could do)."""
        return replace(self, alphas=[max(a, alpha) for a in self.alphas])


def interpolate(points: Sequence[tuple[int, float]], x: float) -> float:
    """The piecewise-linear curve through `points` ((x, y) with x increasing) at x, extended by its
    last segment beyond either end (by its only point's value when there is one)."""
    if len(points) == 1:
        return points[0][1]
    i = 1
    while i < len(points) - 1 and points[i][0] < x:
        i += 1
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def expected_tokens(alphas: Sequence[float], gamma: int) -> float:
    """E(γ) = 1 + Σ_{j=1..γ} Π_{i=1..j} α_i: tokens one round commits (accepted drafts + 1)."""
    total, run = 1.0, 1.0
    for j in range(gamma):
        run *= alphas[j]
        total += run
    return total


def round_seconds(rates: Rates, gamma: int, pipelined: bool) -> float:
    """Expected wall time of one round drafting γ tokens.

    Pipelined, the next block is drafted during this round's wait; that work pays off with the
    probability that all γ drafts and the guessed bonus token (≈ α_{γ+1}) are right.
    """
    draft = gamma * rates.draft_s
    wait = rates.rtt_s + rates.verify_s(gamma)
    if not pipelined:
        return draft + wait
    p_hit = 1.0
    for j in range(gamma + 1):
        p_hit *= rates.alphas[j]
    return draft + wait - p_hit * min(draft, wait)


def hybrid_rate(rates: Rates, gamma: int, pipelined: bool) -> float:
    """Committed tokens per second of hybrid decoding with block length γ."""
    return expected_tokens(rates.alphas, gamma) / round_seconds(rates, gamma, pipelined)


def choose_gamma(rates: Rates, max_gamma: int, pipelined: bool) -> int:
    """The block length in 1..max_gamma with the highest expected tokens per second."""
    return max(range(1, max_gamma + 1), key=lambda g: hybrid_rate(rates, g, pipelined))


def cloud_only_rate(rates: Rates) -> float:
    """Tokens per second of cloud-only streaming: 1/T."""
    return 1.0 / rates.cloud_token_s


def best_speedup(rates: Rates, max_gamma: int, pipelined: bool) -> float:
    """The speed-up of hybrid decoding at its best γ ≤ max_gamma over cloud-only, the ratio of the two
    rates the controller compares; the experiment reports draw their analytic bound from it. With i.i.d. α, no pipelining and t_v
    the same for every γ it is docs/design.md §2's bound max_γ (1 − α^(γ+1)) / ((1 − α)(γc + r + v)),
    with c, r, v the drafter's, the link's and the verifier's times in units of T."""
    gamma = choose_gamma(rates, max_gamma, pipelined)
    return hybrid_rate(rates, gamma, pipelined) / cloud_only_rate(rates)


HYSTERESIS = 0.05  # the other mode must be predicted this much faster (a fraction) before the edge switches


def prefer_cloud_only(rates: Rates, max_gamma: int, pipelined: bool, now_cloud_only: bool,
                      hysteresis: float = HYSTERESIS, remaining_tokens: int | None = None,
                      switch_cost_s: float = 0.0, hybrid: float | None = None) -> bool:
    """Should the edge let the cloud decode alone? `hybrid`: hybrid decoding's predicted rate when the
    caller knows better than the best chain (draft trees: edge/tree_policy.py).

    The answer only flips when the other mode is faster by more than `hysteresis` (a fraction) and,
    given `remaining_tokens`, when the time it saves over them exceeds `switch_cost_s` (a session
    re-open or a new stream: a round trip and a prefill of the whole context).
    """
    if hybrid is None:
        hybrid = hybrid_rate(rates, choose_gamma(rates, max_gamma, pipelined), pipelined)
    cloud = cloud_only_rate(rates)
    current, other = (cloud, hybrid) if now_cloud_only else (hybrid, cloud)
    if other <= current * (1 + hysteresis):
        return now_cloud_only
    if remaining_tokens is not None and remaining_tokens * (1 / current - 1 / other) <= switch_cost_s:
        return now_cloud_only
    return not now_cloud_only
