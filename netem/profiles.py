"""Named link presets for `hybridspec netem --profile` and experiment grids (`grid: {link: [...]}`).

Each preset is a round-trip time, its jitter, a bandwidth per direction and a loss rate, with where
the numbers come from. Where a published measurement exists it is cited; where a figure follows
from physics it says how; the rest are marked as illustrative. A preset is a starting point for a
sweep, not a promise about any particular network: real links vary by place, hour and load, which
is what the `rtt_ms`, `bandwidth_mbps`, `jitter_ms` and `loss_pct` grid keys are for.
"""
from __future__ import annotations

from dataclasses import dataclass

from .shaping import DirectionSpec, LinkSpec


@dataclass(frozen=True)
class LinkProfile:
    """A link as people measure it: both directions' bandwidth, a round trip split evenly."""

    rtt_ms: float
    jitter_ms: float  # each direction's delay varies by ± this
    down_mbps: float  # cloud -> edge
    up_mbps: float  # edge -> cloud
    loss_pct: float
    source: str

    def link_spec(self) -> LinkSpec:
        """The emulator's per-direction settings."""
        one_way = self.rtt_ms / 2
        return LinkSpec(up=DirectionSpec(one_way, self.jitter_ms, self.up_mbps, self.loss_pct),
                        down=DirectionSpec(one_way, self.jitter_ms, self.down_mbps, self.loss_pct))

    def describe(self) -> str:
        """One line for logs and reports."""
        return (f"RTT {self.rtt_ms:g} ms ± {self.jitter_ms:g}, {self.down_mbps:g} down / {self.up_mbps:g} up Mbit/s, "
                f"{self.loss_pct:g} % loss")


PROFILES: dict[str, LinkProfile] = {
    "lan": LinkProfile(0.5, 0.1, 1000, 1000, 0.0,
                       "illustrative: switched gigabit Ethernet in one building, RTT well under a millisecond"),
    "metro-fibre": LinkProfile(2.0, 0.2, 1000, 1000, 0.0,
                               "physics: light in fibre covers about 200 km/ms, so a 100 km metro path is 1 ms of "
                               "round trip before switching; gigabit FTTH access (illustrative)"),
    "lte": LinkProfile(55.0, 10.0, 21.0, 6.3, 0.1,
                       "Opensignal, State of Mobile USA, May 2019: 4G latency 44.1-66.4 ms, 21.3 Mbit/s down, "
                       "6.3 Mbit/s up (telecomengine.com/article/opensignal-benchmarks-5g-readiness-with-new-usa-"
                       "analysis); jitter and loss illustrative"),
    "5g": LinkProfile(25.0, 5.0, 166.0, 21.0, 0.05,
                      "Ookla, Growing and Slowing: The State of 5G Worldwide in 2021: median 166.13 Mbit/s down, "
                      "21.08 Mbit/s up (Speedtest Intelligence, Q3 2021); RTT, jitter and loss illustrative for "
                      "sub-6 GHz 5G"),
    "satellite-geo": LinkProfile(600.0, 20.0, 25.0, 3.0, 0.5,
                                 "physics: a geostationary hop is up and down 35,786 km each way, so the round "
                                 "trip is at least 4 x 35,786 km / c = 477 ms before ground segments; bandwidth "
                                 "and loss illustrative of consumer GEO service"),
    "wifi-lossy": LinkProfile(12.0, 6.0, 30.0, 15.0, 2.0,
                              "illustrative: a congested 2.4 GHz Wi-Fi hop with retransmissions showing as 2 % of "
                              "chunks delayed by an RTO"),
}


def profile(name: str) -> LinkProfile:
    """The preset of that name; ValueError naming the known ones otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown link profile {name!r}; known: {', '.join(PROFILES)}") from None
