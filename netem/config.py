"""`hybridspec netem` configuration: symmetric shaping, with per-direction overrides."""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

from ..common.protocol.channel import DEFAULT_CLOUD_ADDRESS
from .profiles import PROFILES, profile
from .shaping import DirectionSpec, LinkSpec
from .trace import LatencyTrace, load_trace

BACKENDS = ("relay", "tc")  # netem/relay.py (anywhere) and netem/tc.py (where the kernel has sch_netem)

SHAPING_KEYS = ("delay_ms", "jitter_ms", "bandwidth_mbps", "loss_pct", "stall_ms", "stall_every_s")


@dataclass(frozen=True)
class NetemConfig:
    """A relay from `listen` to `upstream`. Each shaping key applies to both directions unless an
    `up_`/`down_` key overrides it (up = edge → cloud, towards upstream; down = back). A `profile`
    (netem/profiles.py) takes the place of the symmetric keys; `up_`/`down_` keys still override it.
    A `trace` (netem/trace.py) takes the place of every delay key, and jitter is in the trace."""

    listen: str = "127.0.0.1:50052"  # HOST:PORT edges connect to
    upstream: str = DEFAULT_CLOUD_ADDRESS  # HOST:PORT of the real server (the cloud front door)
    delay_ms: float = 0.0  # one-way delay in each direction: the round trip grows by 2 × delay_ms
    jitter_ms: float = 0.0  # delay varies uniformly by ± jitter_ms, never reordering bytes
    bandwidth_mbps: float = 0.0  # 0 = unlimited
    loss_pct: float = 0.0  # % of chunks delivered one 200 ms retransmission timeout late
    stall_ms: float = 0.0  # the link freezes this long ...
    stall_every_s: float = 0.0  # ... this often (0 = never)
    up_delay_ms: float | None = None
    up_jitter_ms: float | None = None
    up_bandwidth_mbps: float | None = None
    up_loss_pct: float | None = None
    up_stall_ms: float | None = None
    up_stall_every_s: float | None = None
    down_delay_ms: float | None = None
    down_jitter_ms: float | None = None
    down_bandwidth_mbps: float | None = None
    down_loss_pct: float | None = None
    down_stall_ms: float | None = None
    down_stall_every_s: float | None = None
    seed: int | None = None  # seeds jitter and loss; None = different each run
    profile: str = ""  # a named preset (lan, metro-fibre, lte, 5g, satellite-geo, wifi-lossy); "" = none
    trace: str = ""  # a recorded latency trace to replay (`ping -D` output or t_s,rtt_ms lines); "" = none
    backend: str = "relay"  # relay: the user-space TCP relay; tc: the kernel's netem qdisc on `dev`
    dev: str = "lo"  # the device the tc backend shapes (the relay ignores it; tc ignores `listen`)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.trace:
            delays = [k for k in ("profile", "delay_ms", "jitter_ms", "up_delay_ms", "up_jitter_ms", "down_delay_ms",
                                  "down_jitter_ms") if getattr(self, k)]
            if delays:
                raise ValueError(f"a latency trace sets the delay and its jitter: drop {', '.join(delays)}")
        if self.profile:
            if self.profile not in PROFILES:
                raise ValueError(f"unknown profile {self.profile!r}; known: {', '.join(PROFILES)}")
            given = [k for k in SHAPING_KEYS if getattr(self, k) != getattr(_DEFAULTS, k)]
            if given:
                raise ValueError(f"profile {self.profile} sets the link: drop {', '.join(given)} "
                                 "(or override one direction with up_/down_ keys)")
        self.link_spec()  # validates every value

    def direction(self, which: str) -> DirectionSpec:
        """The shaping of `up` or `down`."""
        base = getattr(profile(self.profile).link_spec(), which) if self.profile else self
        values = {}
        for key in SHAPING_KEYS:
            override = getattr(self, f"{which}_{key}")
            values[key] = getattr(base, key) if override is None else override
        if self.trace:
            values["trace"] = self._trace
        try:
            return DirectionSpec(**values)
        except ValueError as exc:
            raise ValueError(f"{which}: {exc}") from None

    @cached_property
    def _trace(self) -> LatencyTrace:
        return load_trace(self.trace)  # once per config: both directions and every caller share it

    def link_spec(self) -> LinkSpec:
        """Both directions."""
        return LinkSpec(up=self.direction("up"), down=self.direction("down"))


def describe(spec: DirectionSpec) -> str:
    """A short human description of one direction's shaping."""
    parts = [f"{spec.delay_ms:g} ms"]
    if spec.jitter_ms:
        parts.append(f"± {spec.jitter_ms:g} ms")
    if spec.bandwidth_mbps:
        parts.append(f"{spec.bandwidth_mbps:g} Mbit/s")
    if spec.loss_pct:
        parts.append(f"{spec.loss_pct:g}% late by an RTO")
    if spec.trace is not None:
        parts[0] = f"half the RTT of {spec.trace.describe()}"
    if spec.stall_ms:
        parts.append(f"stalls {spec.stall_ms:g} ms every {spec.stall_every_s:g} s")
    return ", ".join(parts)


CONFIG_KEYS = tuple(f.name for f in fields(NetemConfig))
_DEFAULTS = DirectionSpec()
