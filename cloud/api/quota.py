"""Per-identity rate limits on the target's work, in tokens per second (no gRPC, no clock of its own).

A request costs the tokens the target processes for it: a prompt's length at OpenSession, γ + 1 for a
round of γ draft tokens, one per token of a cloud-only stream. The limiter is a virtual-scheduling
token bucket (GCRA): each identity has a theoretical time `tat` at which its budget is spent. An
identity within its rate (plus BURST_S seconds of credit) goes straight through; one running ahead
is paced, each request delayed until it fits; only a request that would have to wait more than
MAX_DELAY_S is refused, with RESOURCE_EXHAUSTED. So an honest edge slightly over its rate slows down
instead of failing, and a flood is turned away without being queued.
"""
from __future__ import annotations

import math

from ...common.security.credentials import Identity
from ...common.protocol.errors import ResourceExhausted

BURST_S = 2.0  # seconds of an identity's rate it may spend at once after being idle
MAX_DELAY_S = 2.0  # the longest a request is held to pace its identity; beyond: RESOURCE_EXHAUSTED
MAX_TRACKED = 65_536  # identities remembered; idle ones are forgotten first


class RateLimiter:
    """Tokens-per-second budgets by identity name."""

    def __init__(self, default_tokens_per_s: float) -> None:
        """default_tokens_per_s: for identities without a rate of their own; 0 = no limit."""
        if default_tokens_per_s < 0 or not math.isfinite(default_tokens_per_s):
            raise ValueError(f"tokens_per_s must be finite and >= 0, got {default_tokens_per_s}")
        self.default = default_tokens_per_s
        self._tat: dict[str, float] = {}

    def rate_of(self, identity: Identity) -> float:
        """The identity's tokens/s (0: unlimited)."""
        return identity.tokens_per_s if identity.tokens_per_s is not None else self.default

    def charge(self, identity: Identity, tokens: int, now: float) -> float:
        """Book `tokens` for `identity` at time `now` (seconds, monotonic). Returns how long the request
        must wait before it runs (0 within budget); ResourceExhausted, booking nothing, if that is
        more than MAX_DELAY_S."""
        rate = self.rate_of(identity)
        if rate == 0 or tokens <= 0:
            return 0.0
        tat = max(self._tat.get(identity.name, now), now)
        new_tat = tat + tokens / rate
        delay = new_tat - now - BURST_S
        if delay > MAX_DELAY_S:
            raise ResourceExhausted(f"{identity.name} is over its limit of {rate:g} tokens/s: this request "
                                    f"({tokens} tokens) would wait {delay:.1f} s; retry in "
                                    f"{delay - MAX_DELAY_S:.1f} s", delay - MAX_DELAY_S)
        if identity.name not in self._tat and len(self._tat) >= MAX_TRACKED:
            self._forget_idle(now)
        self._tat[identity.name] = new_tat
        return max(0.0, delay)

    def _forget_idle(self, now: float) -> None:
        """Drop identities whose budget is whole again (they would start from `now` anyway)."""
        for name in [n for n, t in self._tat.items() if t <= now]:
            del self._tat[name]
        if len(self._tat) >= MAX_TRACKED:  # everyone is busy: forget the earliest-finishing half
            for name in sorted(self._tat, key=self._tat.__getitem__)[:MAX_TRACKED // 2]:
                del self._tat[name]
