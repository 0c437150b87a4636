"""What one generation did: counters the loop updates, and the rates derived from them at the end."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

# The derived rates `to_dict` adds next to the counters (their names are part of the JSON output).
DERIVED = ("acceptance_rate", "mean_tokens_per_round", "mean_gamma", "tokens_per_s", "bytes_per_token",
           "cloud_calls_per_token")


@dataclass
class Stats:
    """Counters of one generation. Rounds are counted through `observe_round`; the rest by name."""

    rounds: int = 0  # verify calls
    drafted: int = 0
    accepted: int = 0
    fallbacks: int = 0  # blocks ended early by the BiLD fallback test
    reopens: int = 0  # sessions re-opened after the verifier lost them
    new_tokens: int = 0
    cloud_only_tokens: int = 0  # tokens the cloud decoded alone
    shadow_guesses: int = 0  # of those, the tokens the drafter guessed alongside (shadow drafting)
    switches_to_cloud: int = 0
    switches_to_hybrid: int = 0
    predrafted: int = 0  # tokens drafted ahead during verification (pipelining)
    pipeline_hits: int = 0  # rounds whose block had been drafted ahead
    offline_tokens: int = 0  # tokens drafted while the cloud was unreachable
    rolled_back: int = 0  # of those, rejected once the cloud was back
    unverified: int = 0  # of those, still unverified at the end
    gamma_sum: int = 0  # block lengths (a tree's node budget) the policy chose, summed over rounds
    tree_rounds: int = 0  # of the rounds, those that sent a draft tree (the rest sent chains)
    drafted_at: list[int] = field(default_factory=list)  # per draft position j: rounds that drafted it
    accepted_at: list[int] = field(default_factory=list)  # per draft position j: rounds that had it accepted
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    feature_bytes: int = 0  # of the downlink, the target's features sent for an eagle drafter
    draft_s: float = 0.0  # time spent drafting on the critical path
    cloud_s: float = 0.0  # time waiting for the cloud
    wall_s: float = 0.0
    cloud_streams: int = 0  # Generate calls
    notices: list[str] = field(default_factory=list)  # every mode switch, with its reason

    def observe_round(self, drafted: int, accepted: int, gamma: int, fell_back: bool = False,
                      drafted_ahead: bool = False, depth: int | None = None) -> None:
        """One verify round: `drafted` tokens sent (γ chosen: `gamma`), `accepted` of them kept. A tree
        gives its `depth`: the per-position counts are then per depth."""
        self.rounds += 1
        self.tree_rounds += depth is not None
        self.drafted += drafted
        self.accepted += accepted
        self.gamma_sum += gamma
        self.fallbacks += fell_back
        self.pipeline_hits += drafted_ahead
        positions = drafted if depth is None else depth
        while len(self.drafted_at) < positions:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for j in range(positions):
            self.drafted_at[j] += 1
            self.accepted_at[j] += j < accepted

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_tokens_per_round(self) -> float:
        """Tokens committed by verify rounds per round."""
        verified = self.new_tokens - self.cloud_only_tokens - self.unverified
        return verified / self.rounds if self.rounds else 0.0

    @property
    def mean_gamma(self) -> float:
        """The block length the policy chose, on average."""
        return self.gamma_sum / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time."""
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def bytes_per_token(self) -> float:
        """Uplink + downlink bytes per new token."""
        return (self.uplink_bytes + self.downlink_bytes) / self.new_tokens if self.new_tokens else 0.0

    @property
    def cloud_calls_per_token(self) -> float:
        """Verify rounds + cloud-only streams per new token."""
        return (self.rounds + self.cloud_streams) / self.new_tokens if self.new_tokens else 0.0

    def to_dict(self) -> dict:
        """Counters and derived rates, for JSON output."""
        return {**asdict(self), **{name: getattr(self, name) for name in DERIVED}}
