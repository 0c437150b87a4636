"""A recorded latency trace, replayed by the link emulator in place of a fixed delay.

Record one on the link you care about with Linux's (iputils) `ping -D -i 0.2 HOST > trace.txt`
(-D stamps each line with the time it was printed), or write `t_s,rtt_ms` lines yourself. Replay is
a step function of link time: each sample's RTT holds until the next sample, the trace loops when it
ends, and each direction gets half the round trip. Probes that got no reply (lost, unreachable)
leave the last RTT in place.
"""
from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

_STAMP = re.compile(r"^\[(?P<t>\d+(?:\.\d+)?)\]")
_RTT = re.compile(r"\btime(?P<op>[=<])(?P<rtt>\d+(?:\.\d+)?) ?ms")
_CSV = re.compile(r"^(?P<t>[^,\s]+)\s*[,\s]\s*(?P<rtt>[^,\s]+)$")
_PING_CHATTER = ("PING ", "---", "rtt ", "round-trip")


@dataclass(frozen=True)
class LatencyTrace:
    """RTT samples in ms at times in seconds from the trace's start (first at 0, increasing)."""

    times_s: tuple[float, ...]
    rtt_ms: tuple[float, ...]
    source: str = ""
    period_s: float = field(init=False)  # one pass: the last sample holds for the median spacing

    def __post_init__(self) -> None:
        name = self.source or "trace"
        if not self.times_s or len(self.times_s) != len(self.rtt_ms):
            raise ValueError(f"{name}: needs one RTT per sample time, and at least one sample")
        if self.times_s[0] != 0 or any(b <= a for a, b in zip(self.times_s, self.times_s[1:])):
            raise ValueError(f"{name}: sample times must start at 0 and increase")
        gaps = sorted(b - a for a, b in zip(self.times_s, self.times_s[1:]))
        object.__setattr__(self, "period_s", self.times_s[-1] + (gaps[len(gaps) // 2] if gaps else 1.0))

    def rtt_at(self, t: float) -> float:
        """The RTT (ms) in force `t` seconds after the link started, looping over the trace."""
        return self.rtt_ms[bisect.bisect_right(self.times_s, t % self.period_s) - 1]

    def describe(self) -> str:
        """One line for logs: where it came from, how many samples, median and p90 RTT."""
        ordered = sorted(self.rtt_ms)

        def pick(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        return (f"trace {self.source}: {len(ordered)} samples over {self.period_s:g} s, "
                f"RTT p50 {pick(0.5):g} ms, p90 {pick(0.9):g} ms")


def parse_trace(text: str, source: str = "") -> LatencyTrace:
    """Samples from `ping -D` output or `t_s,rtt_ms` lines; # comments, a header line and ping's
    other lines are skipped. ValueError naming the line for anything else."""
    samples: list[tuple[float, float]] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        where = f"{source}:{number}"
        if not line or line.startswith(_PING_CHATTER) or "packets transmitted" in line:
            continue
        stamp, rtt = _STAMP.match(line), _RTT.search(line)
        if stamp:
            if not rtt:
                continue  # a probe without a reply: lost or unreachable
            # ping prints `time<1 ms` below its resolution: take the middle of [0, 1).
            sample = (float(stamp["t"]), 0.5 if rtt["op"] == "<" else float(rtt["rtt"]))
        elif rtt:
            raise ValueError(f"{where}: ping reply without a timestamp; record with iputils `ping -D`")
        elif m := _CSV.match(line):
            try:
                sample = (float(m["t"]), float(m["rtt"]))
            except ValueError:
                if not samples:
                    continue  # a header such as t_s,rtt_ms
                raise ValueError(f"{where}: expected t_s,rtt_ms numbers, got {line!r}") from None
        else:
            raise ValueError(f"{where}: expected `ping -D` output or t_s,rtt_ms, got {line!r}")
        if not (all(math.isfinite(v) for v in sample) and sample[1] >= 0):
            raise ValueError(f"{where}: time and RTT must be finite and the RTT >= 0, got {line!r}")
        if samples and sample[0] <= samples[-1][0]:
            raise ValueError(f"{where}: sample times must increase, got {sample[0]:g} after {samples[-1][0]:g}")
        samples.append(sample)
    if not samples:
        raise ValueError(f"{source}: no RTT samples")
    start = samples[0][0]
    return LatencyTrace(tuple(t - start for t, _ in samples), tuple(r for _, r in samples), source)


def load_trace(path: str | Path) -> LatencyTrace:
    """The trace in a file; ValueError naming the file (and line) for anything unreadable."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read latency trace {p}: {getattr(exc, 'strerror', None) or exc}") from None
    return parse_trace(text, str(p))
