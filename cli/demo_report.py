"""What `hybridspec demo` says about the edge's decision: the numbers behind it, in a few lines.

A pure function of what the edge measured and what the cloud reported, so the demo can be truthful
on any machine: where drafting pays it says by how much it was predicted to and did, and where the
edge chose cloud-only it says why in one line. The measured speed is an interval over turns in
which the default edge and cloud-only take turns, never the ratio of one run of each: on a loaded
2-core machine two runs of the same tokens a few seconds apart differ by 20 % and more
(92253c5:bench/demo_fairness.py: single pairs from 0.77 to 1.35 while 102 turns averaged 1.007).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from ..common.protocol.wire import ModelInfo
from ..edge import policy
from ..edge.policy import interpolate
from ..lab.stats import Estimate, mean_ci

FEW_CHECKS = 20  # below this many checks α is mostly its prior and the luck of a few tokens
PERFECT = 0.999  # "a drafter that is always right", kept below 1 so E(γ) stays finite in the closed form


@dataclass(frozen=True)
class Turns:
    """Tokens/s of the default edge and of cloud-only, one pair per turn (the same prompt and settings,
    run back to back, the order alternating from turn to turn)."""

    hybrid_tokens_per_s: tuple[float, ...]  # the default edge's, whichever mode it chose
    cloud_tokens_per_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.hybrid_tokens_per_s or len(self.hybrid_tokens_per_s) != len(self.cloud_tokens_per_s):
            raise ValueError("turns need one default-edge and one cloud-only run each, and at least one turn")

    def speedup(self) -> Estimate:
        """The default edge's tokens/s over cloud-only's in the same turn: the mean and its 95 % interval."""
        return mean_ci([h / c for h, c in zip(self.hybrid_tokens_per_s, self.cloud_tokens_per_s)])


@dataclass(frozen=True)
class Outcome:
    """The default edge's timed generations against cloud-only."""

    rounds: int  # verify rounds the default edge's timed generations ran
    drafted: int
    accepted: int
    turns: Turns
    first_checks: int = 0  # first drafts and shadow guesses checked against the target: what α rests on


def block_cost(info: ModelInfo, gamma: int) -> float | None:
    """v(γ) = t(γ + 1) / t(1) from the cloud's measured pass costs; None if it reported none."""
    if not info.pass_costs:
        return None
    return interpolate(info.pass_costs, gamma + 1) / interpolate(info.pass_costs, 1)


def explain(info: ModelInfo, rates: policy.Rates, cap: int, pipelined: bool, outcome: Outcome) -> list[str]:
    """The decision and its numbers, one line each (rich markup)."""
    gamma = policy.choose_gamma(rates, cap, pipelined)
    predicted = policy.best_speedup(rates, cap, pipelined)
    ceiling = policy.best_speedup(rates.optimistic(PERFECT), cap, pipelined)
    t1 = interpolate(info.pass_costs, 1) if info.pass_costs else None
    v4 = block_cost(info, 4)
    cloud = f"cloud: target weights {info.dtype or '?'} on {info.device or '?'}"
    if t1 is not None and v4 is not None:
        cloud += f"; one token {t1:.1f} ms, a block of 5 costs v = {v4:.2f} tokens' time"
    alpha = rates.alphas[0]
    lines = [
        cloud,
        f"edge: the drafter agrees with the target on α = {alpha:.2f} of first drafts ({_checks(outcome.first_checks)}); drafting costs "
        f"c = {rates.draft_s / rates.cloud_token_s:.2f} of a cloud token; RTT {rates.rtt_s * 1e3:.1f} ms; "
        f"a cloud-only token takes {rates.cloud_token_s * 1e3:.1f} ms",
        f"policy: best block γ = {gamma}, predicted {predicted:.2f}× cloud-only "
        f"(a drafter that is always right: {ceiling:.2f}×)",
        measured(outcome.turns),
    ]
    n = len(outcome.turns.hybrid_tokens_per_s)
    if outcome.rounds:
        lines.append(f"[bold]decision: hybrid[/] — {outcome.rounds} rounds in {n} generations, {outcome.accepted} "
                     f"of {outcome.drafted} drafts accepted")
    elif ceiling < 1:
        lines.append("[bold]decision: cloud-only[/] — even a drafter that is always right would be slower here: "
                     f"verifying a block of {gamma + 1} costs {rates.verify_s(gamma) / rates.verify_s(0):.1f}× one "
                     "token on this replica, more than drafting can save")
    elif predicted <= 1:
        lines.append(f"[bold]decision: cloud-only[/] — at the drafter's agreement (α = {alpha:.2f}) hybrid would "
                     f"reach {predicted:.2f}× cloud-only; it pays only above about α = {_break_even(rates, cap, pipelined):.2f}")
    else:
        lines.append(f"[bold]decision: cloud-only[/] — the edge switches only for a predicted gain of more than "
                     f"{policy.HYSTERESIS:.0%} over the tokens left; with what it measured by the end it predicts "
                     f"{predicted:.2f}× (drafting pays above about α = {_break_even(rates, cap, pipelined):.2f}), so a "
                     "longer generation or the next one drafts")
    return lines


def measured(turns: Turns) -> str:
    """The measured speed as an interval, and what it says: faster, slower, or no difference beyond noise."""
    est = turns.speedup()
    n = est.n
    line = (f"measured over {n} turn{'s' if n > 1 else ''} (each runs both, the order alternating): the default edge "
            f"{statistics.fmean(turns.hybrid_tokens_per_s):.1f} tokens/s, cloud-only "
            f"{statistics.fmean(turns.cloud_tokens_per_s):.1f} tokens/s: {est.value:.2f}× cloud-only")
    if n < 2:
        return line + " (one turn: no interval; two runs here can differ by 20 % and more)"
    line += f", 95 % interval [{est.lo:.2f}, {est.hi:.2f}]: "
    if est.lo > 1:
        return line + "[bold]faster[/] than cloud-only"
    if est.hi < 1:
        return line + f"[bold]slower[/] than cloud-only, by {1 - est.hi:.0%} to {1 - est.lo:.0%}"
    return line + "[bold]the same speed[/] as cloud-only within the noise"


def _checks(n: int) -> str:
    """What α rests on, in words: the estimate starts from a prior of 0.5 and only a few dozen checks
    make it the drafter's own."""
    if n == 0:
        return "nothing checked yet: the prior"
    return f"{n} checked" + (", too few to trust" if n < FEW_CHECKS else "")


def _break_even(rates: policy.Rates, cap: int, pipelined: bool) -> float:
    """The smallest α (to 0.01), the same at every position, at which hybrid would beat cloud-only
    with these times."""
    for hundredths in range(1, 100):
        alike = replace(rates, alphas=[hundredths / 100] * len(rates.alphas))
        if policy.best_speedup(alike, cap, pipelined) > 1:
            return hundredths / 100
    return 1.0
