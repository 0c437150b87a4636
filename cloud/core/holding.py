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
- cohort (the default): the same, but wait only for the sessions the same pass answered as a queued round's session:
  its cohort (a session no pass has answered yet waits for everyone). Sessions a pass could not wait
  for are answered by the next one and become a cohort of their own, so the edges split into groups
  that draft while another group is verified (SpecEdge's two cohorts, formed by the passes
  themselves), and no pass waits for a group that is still drafting. Where a pass's cost grows with its
  rows (a CPU), two groups cost little more than one and overlap drafting with verification.
- quorum: hold until QUORUM of the active sessions have a round queued, at most the longer of `max_wait`
  and HOLD_SHARE of the last pass's time: long enough for a group that is drafting to come back, so
  groups merge into one and stay merged. Where a pass costs about the same for few rounds as for many
  (a GPU below its batch size), one pass per round of every edge is what pays.

Measured (docs/measurements.md, "Rounds that meet"): which wins depends on that cost curve.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from .limits import Hold

QUORUM = 0.9  # the share of active sessions a quorum pass waits for
HOLD_SHARE = 1.0  # of the last pass's time: how long a quorum pass may hold (at least max_wait)


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


def _until(w: Waiting, company: frozenset[str], deadline: float, share: float) -> float | None:
    """Go once `share` of `company` and the queued sessions (at most a pass's worth) have a round
    queued, or at `deadline`; else hold until it."""
    wanted = min(w.max_batch, math.ceil(share * len(company | w.queued)))
    return None if len(w.queued) >= wanted or w.now >= deadline else deadline


def policy(hold: Hold, max_wait_s: float) -> Policy:
    """The policy object for a setting."""
    return {Hold.COMPANY: Company, Hold.COHORT: Cohort, Hold.QUORUM: Quorum}[hold](max_wait_s)
