"""A recorded latency trace, replayed by the link emulator in place of a fixed delay.

Record one on the link you care about with `ping -D -i 0.2 HOST > trace.txt` (-D stamps each reply
with the time it arrived), or write `t_s,rtt_ms` lines yourself. Replay is a step function of link
time: each sample's RTT holds until the next sample, the trace loops when it ends, and each
direction gets half the round trip. Replies ping never got (lost probes) leave the last RTT in place.
"""
from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass
from pathlib import Path

_PING = re.compile(r"^\[(?P<t>\d+(?:\.\d+)?)\].*\btime[=<](?P<rtt>\d+(?:\.\d+)?) ?ms")
_UNSTAMPED_PING = re.compile(r"\btime[=<]\d+(?:\.\d+)? ?ms")
_CSV = re.compile(r"^\s*(?P<t>[-+\d.eE]+)\s*[,\s]\s*(?P<rtt>[-+\d.eE]+)\s*$")


@dataclass(frozen=True)
class LatencyTrace:
    """RTT samples in ms at times in seconds from the trace's start (sorted, first at 0)."""

    times_s: tuple[float, ...]
    rtt_ms: tuple[float, ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not self.times_s or len(self.times_s) != len(self.rtt_ms):
            raise ValueError(f"{self.source or 'trace'}: no RTT samples")
        if any(not (math.isfinite(r) and r >= 0) for r in self.rtt_ms):
            raise ValueError(f"{self.source or 'trace'}: RTTs must be finite and >= 0 ms")
        if list(self.times_s) != sorted(self.times_s) or self.times_s[0] != 0:
            raise ValueError(f"{self.source or 'trace'}: sample times must start at 0 and never go back")

    @property
    def period_s(self) -> float:
        """How long one pass over the trace lasts: the last sample holds for the median spacing."""
        gaps = sorted(b - a for a, b in zip(self.times_s, self.times_s[1:]))
        return self.times_s[-1] + (gaps[len(gaps) // 2] if gaps else 1.0)

    def rtt_at(self, t: float) -> float:
        """The RTT (ms) in force `t` seconds after the link started, looping over the trace."""
        t = t % self.period_s
        return self.rtt_ms[bisect.bisect_right(self.times_s, t) - 1]

    def describe(self) -> str:
        """One line for logs: where it came from, how many samples, median and p90 RTT."""
        ordered = sorted(self.rtt_ms)
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
        return (f"trace {self.source}: {len(ordered)} samples over {self.period_s:g} s, "
                f"RTT p50 {pick(0.5):g} ms, p90 {pick(0.9):g} ms")


def parse_trace(text: str, source: str = "") -> LatencyTrace:
    """Samples from `ping -D` output or `t_s,rtt_ms` lines (# comments and other ping lines skipped)."""
    samples: list[tuple[float, float]] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if m := _PING.search(line):
            samples.append((float(m["t"]), float(m["rtt"])))
        elif _UNSTAMPED_PING.search(line):
            raise ValueError(f"{source}:{number}: ping reply without a timestamp; record with `ping -D`")
        elif m := _CSV.match(line):
            try:
                samples.append((float(m["t"]), float(m["rtt"])))
            except ValueError:
                raise ValueError(f"{source}:{number}: expected t_s,rtt_ms, got {line!r}") from None
        elif line.startswith(("PING ", "---", "rtt ", "round-trip")) or "packets transmitted" in line:
            continue  # ping's header and summary
        else:
            raise ValueError(f"{source}:{number}: expected `ping -D` output or t_s,rtt_ms, got {line!r}")
    if not samples:
        raise ValueError(f"{source}: no RTT samples")
    start = samples[0][0]
    return LatencyTrace(tuple(t - start for t, _ in samples), tuple(r for _, r in samples), source)


def load_trace(path: str | Path) -> LatencyTrace:
    """The trace in a file; ValueError naming the file and line for anything unreadable."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read latency trace {p}: {exc.strerror or exc}") from None
    return parse_trace(text, str(p))
