"""What a replica measures about its own steps and sessions, as plain numbers: no Prometheus here (the
replica may live in another process; the front door exports the snapshots, cloud/api/metrics.py).

- time to first token: from the replica taking a new generation's open to its first answered round
  (prefill, the edge's first draft, the round trip and the round itself);
- inter-token latency: for every later round, the time since the session's previous answer divided
  over the tokens the round committed (each token is one observation, so the mean is seconds/token);
- iteration tokens: the tokens each forward pass carried (rounds' blocks plus prefill chunks);
- where a step's host time goes, part by part (`StepClock`): only when a benchmark asks for it.
"""
from __future__ import annotations

import bisect
import enum
import time
from collections import deque
from dataclasses import dataclass

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class HistogramSnapshot:
    """A histogram's state: counts per bucket (not cumulative; the last one past every bound) and
    the sum of everything observed."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float = 0.0

    @property
    def count(self) -> int:
        """Observations in all."""
        return sum(self.counts)


class Buckets:
    """A running histogram over fixed upper bounds."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bounds must increase, got {bounds}")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._total = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """Count `value` `times` times (a value equal to a bound falls in that bound's bucket)."""
        self._counts[bisect.bisect_left(self.bounds, value)] += times
        self._total += value * times

    def snapshot(self) -> HistogramSnapshot:
        """The state now."""
        return HistogramSnapshot(self.bounds, tuple(self._counts), self._total)


@dataclass(frozen=True)
class ReplicaTelemetry:
    """A replica's histograms since it started, and how full its KV pool is now."""

    ttft: HistogramSnapshot
    itl: HistogramSnapshot
    iteration_tokens: HistogramSnapshot
    kv_usage: float  # fraction of the KV pool's pages in use, 0..1
    # What the auto hold compares (cloud/core/holding.py): the pass-time model's fixed part, and how soon
    # nine in ten answered edges send their next round (inf until measured).
    pass_fixed_s: float
    return_s: float


class Telemetry:
    """The running histograms one Verifier keeps (touched under its lock)."""

    def __init__(self) -> None:
        self.ttft = Buckets(TTFT_BUCKETS)
        self.itl = Buckets(ITL_BUCKETS)
        self.iteration_tokens = Buckets(ITERATION_TOKEN_BUCKETS)

    def snapshot(self, kv_usage: float, pass_fixed_s: float, return_s: float) -> ReplicaTelemetry:
        """Everything, frozen, with the KV pool's fill and what the auto hold compares."""
        return ReplicaTelemetry(self.ttft.snapshot(), self.itl.snapshot(), self.iteration_tokens.snapshot(), kv_usage,
                                pass_fixed_s, return_s)


@dataclass(frozen=True)
class RoundSample:
    """One answered round, as the round metrics count it."""

    gamma: int  # draft tokens
    num_accepted: int
    batch_size: int
    seconds: float  # time the serving endpoint spent on it
    queue_ms: float
    feature_bytes: int = 0  # features sent with the reply (sessions of an EAGLE drafter)


@dataclass(frozen=True)
class Tally:
    """What a replica's own endpoint answered since the front door last asked."""

    rounds: tuple[RoundSample, ...] = ()
    errors: tuple[tuple[str, int], ...] = ()  # (status code, calls)
    tokens: int = 0  # cloud-only tokens its Decode streams sent


class Part(enum.Enum):
    """The parts of a step (cloud/core/verifier.py `Verifier.step`) whose time a StepClock adds up."""

    HOLD = "hold"  # before a step: holding queued rounds for company (its wall time is mostly idle)
    SCHEDULE = "schedule"  # 1-2: taking the queues, admitting opens, plan_pass
    ADMIT = "admit"  # 3-4: each round's admission and its KV reservation
    FORWARD = "forward"  # 5: the engine's pass alone (none of the step's own host work)
    RULES = "rules"  # 6: the pass's accounting, argmaxes and sampling rules, commits, prompt features
    ANSWER = "answer"  # 7: timing and resolving answers, decode streams' next rounds, opens settled


STEP_ENDS_KEPT = 100_000  # steps whose end a StepClock keeps: minutes of steps, a few MiB


class StepClock:
    """Wall and thread-CPU seconds per Part, summed over the steps that ran a pass, the rounds those steps
    answered, and each such step's end and length. Off unless `enabled` (a Verifier's default clock is
    off): then a stamp is one test."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.wall = dict.fromkeys(Part, 0.0)
        self.cpu = dict.fromkeys(Part, 0.0)
        self.steps = 0
        self.rounds = 0
        # Per step: (time.time() at its end, its wall milliseconds); the latest STEP_ENDS_KEPT, so a clock
        # left on does not grow without bound.
        self.ends: deque[tuple[float, float]] = deque(maxlen=STEP_ENDS_KEPT)
        self._wall = self._cpu = self._began = 0.0

    def start(self) -> None:
        """A step begins."""
        if self.enabled:
            self._wall, self._cpu = time.perf_counter(), time.thread_time()
            self._began = self._wall

    def lap(self, part: Part) -> None:
        """The time since the last stamp went to `part`."""
        if self.enabled:
            wall, cpu = time.perf_counter(), time.thread_time()
            self.wall[part] += wall - self._wall
            self.cpu[part] += cpu - self._cpu
            self._wall, self._cpu = wall, cpu

    def done(self, rounds: int) -> None:
        """A step that ran a pass ended, having answered `rounds` rounds."""
        if self.enabled:
            self.steps += 1
            self.rounds += rounds
            self.ends.append((time.time(), (time.perf_counter() - self._began) * 1e3))


class ClockSwitch:
    """A verifier's step clock turned on and off from outside its stepping thread, as a benchmark's window
    does (swapped between steps, which the verifier allows): on, a fresh clock; off, that clock and the CPU
    seconds its whole process spent meanwhile."""

    def __init__(self) -> None:
        self._cpu = 0.0

    def turn(self, verifier, on: bool) -> tuple[StepClock, float] | None:
        """Turn `verifier`'s clock on (None) or off (the clock, and the process's CPU seconds since on)."""
        if on:
            verifier.clock, self._cpu = StepClock(), time.process_time()
            return None
        clock, verifier.clock = verifier.clock, StepClock(enabled=False)
        return clock, time.process_time() - self._cpu
