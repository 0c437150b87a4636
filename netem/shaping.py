"""When each chunk of a TCP byte stream may leave an emulated link: pure timing, no sockets.

One `Shaper` per direction. A chunk that enters at time t is released at
    max(previous release, serialised(t) + delay + jitter + penalties)
where serialised(t) is when a token-bucket link of the given bandwidth has finished sending it.
Taking the max with the previous release keeps bytes in order (jitter without reordering), and a
late chunk holds back the ones behind it, as head-of-line blocking does in TCP. TCP never loses
bytes, so "loss" is what the application sees of it: the lost segment arrives one retransmission
timeout late (Linux's minimum RTO is 200 ms). A recorded latency trace (netem/trace.py) may take the
place of the fixed delay: a chunk then gets half the RTT in force when it entered. Stalls freeze
the link for `stall_ms` every `stall_every_s` seconds: anything in flight then leaves when the stall
ends.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .trace import LatencyTrace

RTO_S = 0.2  # extra delay of a chunk whose segment was "lost": Linux's minimum retransmission timeout


@dataclass(frozen=True)
class DirectionSpec:
    """The shaping of one direction of a link. Validated on construction."""

    delay_ms: float = 0.0  # one-way propagation delay
    jitter_ms: float = 0.0  # the delay varies uniformly in delay ± jitter (as tc netem's), never reordering bytes
    bandwidth_mbps: float = 0.0  # serialisation rate in megabits per second; 0 = unlimited
    loss_pct: float = 0.0  # percentage of chunks delivered one RTO (200 ms) late, as a TCP retransmit would
    stall_ms: float = 0.0  # length of each periodic stall; 0 = none
    stall_every_s: float = 0.0  # period of the stalls
    trace: LatencyTrace | None = None  # replayed RTTs; each chunk's delay is half the RTT in force

    def __post_init__(self) -> None:
        if self.trace is not None and self.delay_ms:
            raise ValueError("a latency trace sets the delay: drop delay_ms")
        for name in ("delay_ms", "jitter_ms", "bandwidth_mbps", "stall_ms", "stall_every_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not 0 <= self.loss_pct < 100:
            raise ValueError(f"loss_pct must be in [0, 100), got {self.loss_pct}")
        if (self.stall_ms > 0) != (self.stall_every_s > 0):
            raise ValueError("stall_ms and stall_every_s go together: give both or neither")
        if self.stall_ms and self.stall_ms / 1e3 >= self.stall_every_s:
            raise ValueError("stall_ms must be shorter than stall_every_s")


class Shaper:
    """Release times for the chunks of one direction, in arrival order."""

    def __init__(self, spec: DirectionSpec, rng: random.Random | None = None, origin: float = 0.0) -> None:
        """origin: the time stalls are counted from (the link's start)."""
        self.spec = spec
        self.rng = rng if rng is not None else random.Random()
        self.origin = origin
        self._link_free = -math.inf  # when the serialiser finishes the previous chunk
        self._last_release = -math.inf

    def release_time(self, arrival: float, nbytes: int) -> float:
        """When a chunk of `nbytes` bytes that arrived at `arrival` (seconds) leaves the link."""
        s = self.spec
        start = max(arrival, self._link_free)
        start = self._after_stall(start)
        done = start + (nbytes * 8 / (s.bandwidth_mbps * 1e6) if s.bandwidth_mbps else 0.0)
        self._link_free = done
        delay = (s.trace.rtt_at(arrival - self.origin) / 2 if s.trace else s.delay_ms) / 1e3
        if s.jitter_ms:
            delay = max(0.0, delay + self.rng.uniform(-s.jitter_ms, s.jitter_ms) / 1e3)
        release = done + delay
        if s.loss_pct and self.rng.random() * 100 < s.loss_pct:
            release += RTO_S
        release = self._after_stall(max(release, self._last_release))
        self._last_release = release
        return release

    def _after_stall(self, t: float) -> float:
        """t, or the end of the stall that t falls in."""
        s = self.spec
        if not s.stall_ms:
            return t
        since = (t - self.origin) % s.stall_every_s
        # Each period ends with its stall: [period - stall, period).
        stall_start = s.stall_every_s - s.stall_ms / 1e3
        return t + (s.stall_every_s - since) if since >= stall_start else t


@dataclass(frozen=True)
class LinkSpec:
    """Both directions: `up` carries edge → cloud bytes, `down` cloud → edge."""

    up: DirectionSpec = DirectionSpec()
    down: DirectionSpec = DirectionSpec()

    @classmethod
    def symmetric(cls, **direction) -> LinkSpec:
        """The same shaping both ways (so the round trip grows by 2 × delay_ms)."""
        spec = DirectionSpec(**direction)
        return cls(up=spec, down=spec)
