"""When a pass starts: how long the model thread holds queued rounds for the company of other sessions'
rounds. A policy is a pure function of what the thread knows while it holds them (`Waiting`: no clock,
no lock, no engine); the verifier asks it when rounds are queued and again at each arrival, and starts
the pass when it says so (cloud/core/verifier.py `_wait_for_company`).

Why hold at all: a pass costs nearly as much for a few rounds as for many (on a GPU, up to the batch the
weights' streaming hides), and edges answered together come back together, a drafting time later and
spread by their links and the server's own reading of their requests. Why not long: a held round's edge
waits, so every policy is bounded, and a lone edge never waits (nobody else is active). The policies:

- company: hold while a recently active session has no round queued, at most `max_wait` after the
  model became free or the oldest round arrived, whichever is later.
- cohort: the same, but wait only for the sessions the same pass answered as a queued round's session:
  its cohort (a session no pass has answered yet waits for everyone). Sessions a pass could not wait
  for are answered by the next one and become a cohort of their own, so the edges split into groups
  that draft while another group is verified (SpecEdge's two cohorts, formed by the passes
  themselves), and no pass waits for a group that is still drafting. Where a pass's cost grows with its
  rows (a CPU), two groups cost little more than one and overlap drafting with verification.
- quorum: hold until QUORUM of the active sessions have a round queued, at most the longer of `max_wait`
  and HOLD_SHARE of the last pass's time: long enough for a group that is drafting to come back, so
  groups merge into one and stay merged. Where a pass costs about the same for few rounds as for many
  (a GPU below its batch size), one pass per round of every edge is what pays.
- auto (the default): quorum where merging the groups pays, cohort where it does not, decided afresh
  each time rounds are held, from what the replica has measured. Two groups cost one pass's fixed part
  (the pass-time model's: what a pass costs however few rows it has) more per round of every edge than
  one group does;
  one group waits, each round, for its slowest edges to come back (the QUORUM share of the measured gaps
  from a round's answer to its session's next round: drafting, the links and the front door). So
  merging pays when that return takes less than the fixed part: on a GPU whose pass of a few rows costs
  nearly what one of many does, with edges close by; on a CPU, where the rows are most of a pass, it
  does not.

Measured (docs/measurements.md, "Rounds that meet"): which wins depends on that cost curve, and auto
follows it.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from .limits import Hold

QUORUM = 0.9  # the share of active sessions a quorum pass waits for
HOLD_SHARE = 1.0  # of the last pass's time: how long a quorum pass may hold (at least max_wait)
RETURN_SAMPLES = 256  # the latest returns (answer to next round) that auto reads: a few steps' worth at 64 edges


@dataclass(frozen=True)
class Waiting:
    """What the model thread knows while it holds rounds (seconds on one monotonic clock)."""

    now: float
    since: float  # holding began: the later of the model becoming free and the oldest round's arrival
    queued: frozenset[str]  # sessions with a round queued
    active: frozenset[str]  # sessions that sent a round recently, the queued ones included
    max_batch: int  # rounds one pass may carry
    last_pass_s: float = 0.0  # the last pass's time, host work included (0 before the first)
    cohorts: Mapping[str, int] = field(default_factory=dict)  # session -> the pass that answered its last round
    fixed_s: float = 0.0  # what a pass costs however few rows it has (the pass-time model's fixed part)
    return_s: float = math.inf  # how soon QUORUM of answered sessions send their next round (inf: not measured)


class Policy(Protocol):
    """Decides when held rounds go."""

    def hold_until(self, w: Waiting) -> float | None:
        """None: start the pass now; else hold until this time at the latest (asked again when a round arrives)."""


@dataclass(frozen=True)
class Company:
    """Hold for every recently active session, at most max_wait_s."""

    max_wait_s: float

    def hold_until(self, w: Waiting) -> float | None:
        return _until(w, w.active, w.since + self.max_wait_s, 1.0)


@dataclass(frozen=True)
class Cohort:
    """Hold for the recently active sessions answered by the same pass as a queued round, at most max_wait_s."""

    max_wait_s: float

    def hold_until(self, w: Waiting) -> float | None:
        passes = {w.cohorts.get(s) for s in w.queued}
        # A session no pass has answered yet belongs to no cohort: it waits for everyone, as with company.
        cohort = w.active if None in passes else frozenset(s for s in w.active if w.cohorts.get(s) in passes)
        return _until(w, cohort, w.since + self.max_wait_s, 1.0)


@dataclass(frozen=True)
class Quorum:
    """Hold until QUORUM of the recently active sessions have a round queued, at most the longer of
    max_wait_s and HOLD_SHARE of the last pass."""

    max_wait_s: float

    def hold_until(self, w: Waiting) -> float | None:
        return _until(w, w.active, w.since + max(self.max_wait_s, HOLD_SHARE * w.last_pass_s), QUORUM)


@dataclass(frozen=True)
class Auto:
    """Quorum while answered sessions come back sooner than a pass's fixed part (one group pays), else cohort."""

    max_wait_s: float

    def hold_until(self, w: Waiting) -> float | None:
        merge = Quorum if w.return_s < w.fixed_s else Cohort
        return merge(self.max_wait_s).hold_until(w)


class Returns:
    """How long answered sessions take to send their next round: the gap from a round's answer to the
    arrival of its session's next round, over the latest RETURN_SAMPLES. A gap longer than `active_s` is
    not kept: that session was no longer active company to wait for. Times are the caller's clock."""

    def __init__(self, active_s: float) -> None:
        self.active_s = active_s
        self._answered: dict[str, float] = {}  # session -> when its last round was answered, until the next arrives
        self._gaps: deque[float] = deque(maxlen=RETURN_SAMPLES)

    def answered(self, session_id: str, at: float) -> None:
        """A round of the session was answered `at`."""
        self._answered[session_id] = at

    def arrived(self, session_id: str, at: float) -> None:
        """The session's next round arrived `at`."""
        answered = self._answered.pop(session_id, None)
        if answered is not None and at - answered <= self.active_s:
            self._gaps.append(max(0.0, at - answered))

    def forget(self, session_id: str) -> None:
        """The session closed or went quiet: no gap is measured to its next round."""
        self._answered.pop(session_id, None)

    def within(self, share: float) -> float:
        """The gap within which `share` of the kept returns came (inf before any)."""
        if not self._gaps:
            return math.inf
        gaps = sorted(self._gaps)
        return gaps[max(0, min(len(gaps), math.ceil(share * len(gaps))) - 1)]


def _until(w: Waiting, company: frozenset[str], deadline: float, share: float) -> float | None:
    """Go once `share` of `company` and the queued sessions (at most a pass's worth) have a round
    queued, or at `deadline`; else hold until it."""
    wanted = min(w.max_batch, math.ceil(share * len(company | w.queued)))
    return None if len(w.queued) >= wanted or w.now >= deadline else deadline


def policy(hold: Hold, max_wait_s: float) -> Policy:
    """The policy object for a setting."""
    return {Hold.COMPANY: Company, Hold.COHORT: Cohort, Hold.QUORUM: Quorum, Hold.AUTO: Auto}[hold](max_wait_s)
