"""Running estimates of acceptance, drafting, verification and network times (feeds edge/policy.py).

Everything decays, so the estimates follow a link whose RTT changes or a text that gets easier.
Priors keep the first rounds sensible: α_j starts at `prior_alpha` with the weight of a few rounds,
times start at the values given (or are learnt from the first measurement).

One worker's estimates are shared by every generation it runs (`edge serve` runs several at once, on
threads) and by the background RTT probe, and every update reads before it writes: each estimate
takes a lock around its update, so no observation is lost to a thread switch.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

from .policy import Rates, interpolate

DECAY = 0.9  # weight of the past per new observation (≈ the last 10 observations count)
RANKS = 8  # the drafter's choices whose agreement with the target is counted (ρ_1..ρ_8, for trees)
# Before any observation: first choice as prior_alpha says, then a quickly thinning tail (weights of
# the prior's rounds; a few rounds outweigh it).
PRIOR_RANK_SHARES = (0.15, 0.07, 0.04, 0.03, 0.02, 0.015, 0.01)


@dataclass
class Ewma:
    """An exponentially weighted mean; None until the first observation unless given a prior."""

    value: float | None = None
    decay: float = DECAY
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, x: float) -> None:
        """Fold in one observation."""
        with self._lock:
            self.value = x if self.value is None else self.decay * self.value + (1 - self.decay) * x

    def get(self, default: float) -> float:
        """The mean, or `default` before any observation."""
        return default if self.value is None else self.value


@dataclass
class LinearFit:
    """y ≈ a + b·x by decayed least squares; flat (b = 0) while the x seen are too alike."""

    decay: float = DECAY
    _s: list[float] = field(default_factory=lambda: [0.0] * 5)  # Σw, Σwx, Σwy, Σwxx, Σwxy
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, x: float, y: float) -> None:
        """Fold in one (x, y)."""
        with self._lock:
            s = [self.decay * s for s in self._s]
            for i, v in enumerate((1.0, x, y, x * x, x * y)):
                s[i] += v
            self._s = s

    @property
    def fitted(self) -> bool:
        """True once any observation came in."""
        return self._s[0] > 0

    def coefficients(self) -> tuple[float, float]:
        """(a, b); (mean y, 0) when the x spread is too small to tell a slope, or the slope is negative."""
        w, sx, sy, sxx, sxy = self._s  # one list, replaced whole by `add`: a consistent snapshot
        var = sxx / w - (sx / w) ** 2
        if var < 0.5:  # x within about ±0.7 of its mean
            return sy / w, 0.0
        b = (sxy / w - (sx / w) * (sy / w)) / var
        return (sy / w, 0.0) if b < 0 else (sy / w - b * sx / w, b)


@dataclass
class VerifyCost:
    """The verifier's time per round.

    With the cloud's measured pass costs (GetModelInfo), t_v(γ) is that curve at γ + 1 tokens plus
    `residual`, what rounds cost beyond the bare pass (the verification rule, waiting for a batch,
    other sessions in it): the cloud knows the shape, the edge measures the level. Without them, an
    empty block (γ = 0) is measured on its own (on CPUs the jump from one position to several is
    larger than any later step) and blocks of γ ≥ 1 are fitted as a line in γ.
    """

    single: Ewma = field(default_factory=Ewma)
    blocks: LinearFit = field(default_factory=LinearFit)
    pass_costs: tuple[tuple[int, float], ...] = ()  # (tokens, seconds), from the cloud
    residual: Ewma = field(default_factory=Ewma)
    # Per B > 1: (tokens per session, seconds) of passes of B sessions (ModelInfo.batch_pass_costs).
    batch_costs: dict[int, tuple[tuple[int, float], ...]] = field(default_factory=dict)

    def add(self, gamma: int, seconds: float) -> None:
        """One round of γ drafts took `seconds` on the verifier."""
        if gamma == 0:
            self.single.add(seconds)
        else:
            self.blocks.add(gamma, seconds)
        if self.pass_costs:
            self.residual.add(seconds - interpolate(self.pass_costs, gamma + 1))

    def curve(self, max_gamma: int, load: float = 1.0) -> tuple[float, ...]:
        """t_v(0..max_gamma) from the cloud's curve and the residual; () without a curve.

        `load` (≥ 1: a streamed token's time over the cloud's own one-token pass) prices a round as
        if the replica's other sessions grew their passes as this one does, t(γ+1)·load, wherever that
        is more than the rounds measured. Each edge judging alone against a loaded replica saw only
        its own round's cost: on a compute-bound CPU replica every edge then chose hybrid and all got
        slower (16 edges: 0.69x cloud-only per edge). On a GPU t(γ+1) ≈ t(1), and load costs both modes alike.
        """
        if not self.pass_costs:
            return ()
        extra = self.residual.get(0.0)
        costs = [interpolate(self.pass_costs, g + 1) for g in range(max_gamma + 1)]
        batch = self.batch_like(load)
        if batch is not None:  # the measured cost of γ when that many sessions share the pass
            shared = [interpolate(self.batch_costs[batch], g + 1) for g in range(max_gamma + 1)]
            return tuple(max(0.0, t + extra, b) for t, b in zip(costs, shared))
        return tuple(max(0.0, t + extra, t * load) for t in costs)

    def batch_like(self, load: float) -> int | None:
        """The measured batch size B whose one-token pass, over one session's, is nearest `load` (in
        ratio); None when one session alone is nearer, or no batch was measured."""
        if not self.batch_costs or not self.pass_costs or load <= 1.0:
            return None
        t1 = interpolate(self.pass_costs, 1)
        gaps = {b: abs(math.log(interpolate(c, 1) / t1 / load)) for b, c in self.batch_costs.items()}
        best = min(gaps, key=gaps.get)
        return best if gaps[best] < abs(math.log(load)) else None


class Estimates:
    """What the edge has measured so far."""

    def __init__(self, max_positions: int, prior_alpha: float = 0.5, prior_weight: float = 2.0) -> None:
        self._tries = [prior_weight] * (max_positions + 1)
        self._hits = [prior_weight * prior_alpha] * (max_positions + 1)
        self._checked = [0] * (max_positions + 1)  # plain counts of the checks behind each α_j (no prior, no decay)
        self._rank_seen = prior_weight
        self._rank_hits = [prior_weight * share for share in (prior_alpha, *PRIOR_RANK_SHARES)]
        self.draft_s = Ewma()
        self.tree_node_s = Ewma()  # a tree's drafting time per node (its levels batch nodes, its Python does not)
        self.rtt_s = Ewma()
        self.cloud_token_s = Ewma()
        self.prefill_per_token_s = Ewma()  # opening a session: the verifier's cost per context token
        self.verify = VerifyCost()
        self.unshadowed_windows = 0  # cloud-only windows since the last one shadow-drafted (how stale α is)
        self._lock = threading.Lock()  # guards the per-position counts

    def observe_open(self, seconds: float, context_tokens: int) -> None:
        """A session open, or a cloud-only stream's wait for its first token, took `seconds` for a
        context of `context_tokens`: both are a round trip and a prefill (behind any queue)."""
        self.prefill_per_token_s.add(max(0.0, seconds - self.rtt_s.get(0.0)) / max(1, context_tokens))

    def switch_cost_s(self, context_tokens: int) -> float:
        """What changing mode costs: a round trip and a prefill of the context (re-open or new stream)."""
        return self.rtt_s.get(0.0) + self.prefill_per_token_s.get(0.0) * context_tokens

    def use_pass_costs(self, points_ms: tuple[tuple[int, float], ...],
                       batch_ms: tuple[tuple[int, int, float], ...] = ()) -> None:
        """The cloud's measured cost per pass size (ModelInfo.pass_costs) and per batch size
        (ModelInfo.batch_pass_costs: (B, M, ms)); a new curve (another cloud) starts the residual afresh."""
        curve = tuple((m, ms / 1e3) for m, ms in points_ms)
        if curve != self.verify.pass_costs:
            self.verify.pass_costs = curve
            self.verify.residual = Ewma()
        batches: dict[int, list[tuple[int, float]]] = {}
        for b, m, ms in batch_ms:
            batches.setdefault(b, []).append((m, ms / 1e3))
        self.verify.batch_costs = {b: tuple(points) for b, points in batches.items()}

    def observe_verify(self, gamma: int, seconds: float) -> None:
        """The verifier's own time for a round of γ drafts."""
        self.verify.add(gamma, seconds)

    @property
    def alphas(self) -> list[float]:
        """α_1, α_2, ... (the last entry stands for every deeper position)."""
        with self._lock:
            return [h / t for h, t in zip(self._hits, self._tries)]

    def observe_round(self, drafted: int, accepted: int, bonus_guess_right: bool | None = None) -> None:
        """One verify round: positions 1..accepted were accepted, position accepted+1 (if drafted) was not.

        bonus_guess_right: with a fully accepted block, whether the pipelined guess of the bonus
        token matched (a sample of position drafted+1); None when there was no guess.
        """
        with self._lock:
            for j in range(len(self._tries)):
                self._tries[j] *= DECAY
                self._hits[j] *= DECAY
            for j in range(min(accepted + 1, drafted)):
                self._tries[j] += 1
                self._checked[j] += 1
                self._hits[j] += j < accepted
            if accepted == drafted and bonus_guess_right is not None and drafted < len(self._tries):
                self._tries[drafted] += 1
                self._hits[drafted] += bonus_guess_right

    @property
    def checked(self) -> list[int]:
        """How many drafts (or shadow guesses) at each position were checked against the target so
        far: what α_j rests on, before the prior and the decay."""
        with self._lock:
            return list(self._checked)

    @property
    def ranks(self) -> list[float]:
        """ρ_1..ρ_RANKS: how often the target's token was the drafter's r-th choice."""
        with self._lock:
            return [h / self._rank_seen for h in self._rank_hits]

    def observe_ranks(self, ranks: list[int | None]) -> None:
        """Ranks (1-based) of the target's tokens among the drafter's choices where both are known;
        None: outside the drafter's first RANKS choices."""
        with self._lock:
            for rank in ranks:
                self._rank_seen = self._rank_seen * DECAY + 1
                self._rank_hits = [h * DECAY + (rank == r + 1) for r, h in enumerate(self._rank_hits)]

    def observe_shadow(self, agreed: bool, position: int = 0) -> None:
        """A drafter guess checked against a token the cloud decoded alone (cloud-only mode)."""
        j = min(position, len(self._tries) - 1)
        with self._lock:
            self._tries[j] = self._tries[j] * DECAY + 1
            self._checked[j] += 1
            self._hits[j] = self._hits[j] * DECAY + agreed

    def rates(self, defaults: Rates) -> Rates:
        """Current beliefs; `defaults` fills in what was never measured.

        Until an empty block was verified, t_v(0) is taken as the cloud's per-token time T (and T
        as t_v(0) until a cloud-only stream was timed): both are the target decoding one token.
        """
        t_cloud = self.cloud_token_s.value
        single = self.verify.single.value
        single = single if single is not None else t_cloud if t_cloud is not None else defaults.verify_single_s
        if self.verify.blocks.fitted:
            a, b = self.verify.blocks.coefficients()
        else:
            a, b = defaults.verify_block_s, defaults.verify_per_draft_s
        pass_costs = self.verify.pass_costs
        load = max(1.0, t_cloud / interpolate(pass_costs, 1)) if pass_costs and t_cloud is not None else 1.0
        return Rates(alphas=self.alphas, draft_s=self.draft_s.get(defaults.draft_s),
                     rtt_s=self.rtt_s.get(defaults.rtt_s), verify_single_s=single, verify_block_s=a,
                     verify_per_draft_s=b, cloud_token_s=t_cloud if t_cloud is not None else single,
                     verify_curve_s=self.verify.curve(len(self._tries), load), tree_node_s=self.tree_node_s.get(0.0))
