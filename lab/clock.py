"""When a generation's tokens became final, as the edge saw them: time to first token, the gaps
between commits, and a per-token trace file."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


class CommitClock:
    """When a generation's tokens became final, from the edge's side."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.commits: list[tuple[float, list[int], object]] = []  # (seconds since start, tokens, origins)

    def start(self) -> None:
        """The generation starts now."""
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since start."""
        return time.perf_counter() - self.t0

    def commit(self, tokens, origins) -> None:
        """Tokens became final now (origins: one per token, or one for all)."""
        self.commits.append((self.elapsed(), list(tokens), origins))

    def summary(self) -> dict:
        """Time to first token, and the median and 95th percentile of the gaps between commits."""
        times = [t for t, _, _ in self.commits]
        gaps = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
        out = {"ttft_s": times[0] if times else None}
        if len(gaps) >= 2:
            out.update(step_ms_p50=statistics.median(gaps), step_ms_p95=statistics.quantiles(gaps, n=20)[-1])
        return out

    def write(self, path: Path | None) -> None:
        """One JSON line per committed token: its time, id and origin."""
        if path is None:
            return
        with path.open("w") as f:
            for t, tokens, origins in self.commits:
                names = origins if isinstance(origins, list) else [origins] * len(tokens)
                for token, origin in zip(tokens, names):
                    f.write(json.dumps({"t_s": round(t, 6), "token": token, "origin": origin}) + "\n")
