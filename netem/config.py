"""`hybridspec netem` configuration: symmetric shaping, with per-direction overrides."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..common.config import Choice, check_fields, setting
from ..common.protocol.channel import DEFAULT_CLOUD_ADDRESS
from .profiles import PROFILES, profile
from .shaping import DirectionSpec, LinkSpec
from .trace import LatencyTrace, load_trace

class NetemBackend(Choice):
    """How the link is emulated."""

    RELAY = "relay"  # netem/relay.py: a user-space TCP relay, anywhere
    TC = "tc"  # netem/tc.py: the kernel's netem qdisc, where the kernel has sch_netem


SHAPING_KEYS = ("delay_ms", "jitter_ms", "bandwidth_mbps", "loss_pct", "stall_ms", "stall_every_s")


def _up(help: str) -> object:
    return setting(None, f"{help} (up only: edge to cloud)")


def _down(help: str) -> object:
    return setting(None, f"{help} (down only: cloud to edge)")


@dataclass(frozen=True)
class NetemConfig:
    """A relay from `listen` to `upstream`. Each shaping key applies to both directions unless an
    `up_`/`down_` key overrides it (up = edge → cloud, towards upstream; down = back). A `profile`
    (netem/profiles.py) takes the place of the symmetric keys; `up_`/`down_` keys still override it.
    A `trace` (netem/trace.py) takes the place of every delay key, and jitter is in the trace."""

    listen: str = setting("127.0.0.1:50052", "HOST:PORT edges connect to")
    upstream: str = setting(DEFAULT_CLOUD_ADDRESS, "HOST:PORT of the real server (the cloud front door)")
    delay_ms: float = setting(0.0, "one-way delay in each direction: the round trip grows by twice this")
    jitter_ms: float = setting(0.0, "the delay varies uniformly by this much either way, never reordering bytes")
    bandwidth_mbps: float = setting(0.0, "bandwidth cap in Mbit/s; 0 = none")
    loss_pct: float = setting(0.0, "percentage of chunks delivered one 200 ms retransmission timeout late")
    stall_ms: float = setting(0.0, "the link freezes this long ...")
    stall_every_s: float = setting(0.0, "... this often; 0 = never")
    up_delay_ms: float | None = _up("one-way delay")
    up_jitter_ms: float | None = _up("jitter")
    up_bandwidth_mbps: float | None = _up("bandwidth cap")
    up_loss_pct: float | None = _up("late-chunk percentage")
    up_stall_ms: float | None = _up("stall length")
    up_stall_every_s: float | None = _up("stall period")
    down_delay_ms: float | None = _down("one-way delay")
    down_jitter_ms: float | None = _down("jitter")
    down_bandwidth_mbps: float | None = _down("bandwidth cap")
    down_loss_pct: float | None = _down("late-chunk percentage")
    down_stall_ms: float | None = _down("stall length")
    down_stall_every_s: float | None = _down("stall period")
    seed: int | None = setting(None, "seeds jitter and loss; none: different each run")
    profile: str = setting("", "a named link preset (docs/experiments.md cites their sources); up_/down_ keys "
                               "still override one direction", choices=("", *PROFILES))
    trace: str = setting("", "replay a recorded latency trace (`ping -D` output or t_s,rtt_ms lines) in place of "
                             "the delay keys; each direction gets half the RTT in force")
    backend: NetemBackend = setting(NetemBackend.RELAY, "relay: a user-space TCP relay on listen; tc: the "
                                                        "kernel's netem qdisc on dev for upstream's port (root, "
                                                        "sch_netem); edges then connect to upstream itself")
    dev: str = setting("lo", "the device the tc backend shapes (on a NIC, run it on both hosts)")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.trace:
            delays = [k for k in ("profile", "delay_ms", "jitter_ms", "up_delay_ms", "up_jitter_ms", "down_delay_ms",
                                  "down_jitter_ms") if getattr(self, k)]
            if delays:
                raise ValueError(f"a latency trace sets the delay and its jitter: drop {', '.join(delays)}")
        if self.profile:
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

_DEFAULTS = DirectionSpec()
