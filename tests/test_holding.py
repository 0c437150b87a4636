"""When a pass starts (cloud/core/holding.py): the batching policies as pure functions, today's policy
against the rule the model thread used to compute inline, the cohort policy on the model thread, and what
auto reads there (the pass's fixed part, how soon edges come back)."""
import math
import random
import time

import pytest

from conftest import started
from hybridspec.cloud.core.holding import (HOLD_SHARE, QUORUM, RETURN_SAMPLES, Auto, Cohort, Company, Quorum,
                                          Returns, Waiting, policy)
from hybridspec.cloud.core.limits import Hold, VerifierLimits
from hybridspec.cloud.core.verifier import Verifier
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec


def waiting(queued, active, now=0.0, since=0.0, max_batch=64, last_pass_s=0.0, cohorts=None, fixed_s=0.0,
            return_s=math.inf) -> Waiting:
    return Waiting(now, since, frozenset(queued), frozenset(active) | frozenset(queued), max_batch, last_pass_s,
                   cohorts or {}, fixed_s, return_s)


def test_company_holds_for_every_active_session_until_max_wait():
    hold = Company(0.002)
    assert hold.hold_until(waiting("ab", "abc", now=0.001)) == 0.002  # c is active: hold for it
    assert hold.hold_until(waiting("abc", "abc", now=0.001)) is None  # everyone is in
    assert hold.hold_until(waiting("ab", "abc", now=0.002)) is None  # the bound
    assert hold.hold_until(waiting("a", "a")) is None  # a lone edge never waits
    assert hold.hold_until(waiting("ab", "abcd", max_batch=2)) is None  # a full pass goes


@pytest.mark.parametrize("seed", range(5))
def test_company_is_the_rule_the_model_thread_computed_inline(seed):
    """The old `_wait_for_company` returned when len(queued) >= min(max_batch, len(recent | queued)) or
    now >= deadline, else waited until the deadline: the default policy must not change a decision."""
    rng = random.Random(seed)
    for _ in range(300):
        ids = [f"s{i}" for i in range(rng.randint(1, 12))]
        queued, recent = set(rng.sample(ids, rng.randint(1, len(ids)))), set(rng.sample(ids, rng.randint(0, len(ids))))
        now, since, max_batch, wait = rng.random(), rng.random(), rng.randint(1, 12), rng.random() / 10
        deadline = since + wait
        old = None if len(queued) >= min(max_batch, len(recent | queued)) or now >= deadline else deadline
        assert Company(wait).hold_until(waiting(queued, recent, now, since, max_batch)) == old


def test_cohort_holds_only_for_the_sessions_the_same_pass_answered():
    hold = Cohort(0.002)
    cohorts = {"a": 1, "b": 1, "c": 2, "d": 2}
    assert hold.hold_until(waiting("a", "abcd", now=0.001, cohorts=cohorts)) == 0.002  # b is a's company
    assert hold.hold_until(waiting("ab", "abcd", now=0.001, cohorts=cohorts)) is None  # c, d are drafting
    assert hold.hold_until(waiting("abc", "abcd", now=0.001, cohorts=cohorts)) == 0.002  # c's cohort waits for d
    assert hold.hold_until(waiting("e", "abcde", cohorts=cohorts)) == 0.002  # no pass answered e: it waits for all
    assert hold.hold_until(waiting("ae", "abcde", cohorts=cohorts)) == 0.002
    assert hold.hold_until(waiting("a", "abcd", now=0.002, cohorts=cohorts)) is None


def test_quorum_goes_with_most_and_holds_longer_after_long_passes():
    hold = Quorum(0.002)
    ten = "abcdefghij"
    assert QUORUM == 0.9
    assert hold.hold_until(waiting(ten[:8], ten, now=0.001)) == 0.002  # 8 of 10 active: hold
    assert hold.hold_until(waiting(ten[:9], ten, now=0.001)) is None  # 9 of 10: go
    assert hold.hold_until(waiting(ten[:9], ten + "k", now=0.001)) == 0.002  # 9 of 11: hold (ceil(9.9) = 10)
    # After a 40 ms pass it may hold as long as that pass (long enough for a drafting group to come back).
    assert HOLD_SHARE == 1.0
    assert hold.hold_until(waiting(ten[:5], ten, now=0.005, last_pass_s=0.04)) == pytest.approx(0.04)
    assert hold.hold_until(waiting(ten[:5], ten, now=0.0401, last_pass_s=0.04)) is None
    assert hold.hold_until(waiting(ten[:5], ten, now=0.001, last_pass_s=0.0004)) == 0.002  # at least max_wait


@pytest.mark.parametrize("seed", range(3))
def test_auto_is_quorum_while_edges_come_back_sooner_than_a_pass_s_fixed_part_else_cohort(seed):
    rng = random.Random(seed)
    for _ in range(300):
        ids = [f"s{i}" for i in range(rng.randint(1, 12))]
        w = waiting(set(rng.sample(ids, rng.randint(1, len(ids)))), set(rng.sample(ids, rng.randint(0, len(ids)))),
                    now=rng.random() / 50, since=rng.random() / 100, max_batch=rng.randint(1, 12),
                    last_pass_s=rng.random() / 20, cohorts={i: rng.randint(0, 2) for i in ids if rng.random() < 0.8},
                    fixed_s=rng.random() / 50, return_s=rng.choice([math.inf, rng.random() / 50]))
        wait = rng.random() / 100
        expected = Quorum(wait) if w.return_s < w.fixed_s else Cohort(wait)
        assert Auto(wait).hold_until(w) == expected.hold_until(w)
    # The case that tells them apart: 8 of 10 active are in, the others answered by another pass.
    ten, cohorts = "abcdefghij", {**dict.fromkeys("abcdefgh", 1), "i": 2, "j": 2}
    merging = waiting(ten[:8], ten, now=0.001, last_pass_s=0.015, cohorts=cohorts, fixed_s=0.014, return_s=0.005)
    assert Auto(0.002).hold_until(merging) == pytest.approx(0.015)  # one group pays: hold for a quorum (i)
    apart = waiting(ten[:8], ten, now=0.001, last_pass_s=0.015, cohorts=cohorts, fixed_s=0.001, return_s=0.005)
    assert Auto(0.002).hold_until(apart) is None  # two groups pay: a's cohort is in, go


def test_returns_are_the_gaps_from_an_answer_to_the_next_round_of_active_sessions():
    returns = Returns(active_s=0.5)
    assert returns.within(0.9) == math.inf  # nothing measured yet
    returns.arrived("a", 1.0)  # a first round: no answer before it
    assert returns.within(0.9) == math.inf
    for i in range(10):
        returns.answered(f"s{i}", 2.0)
        returns.arrived(f"s{i}", 2.0 + (i + 1) / 1000)  # 1 to 10 ms
    assert returns.within(0.9) == pytest.approx(0.009)  # nine in ten came back within 9 ms
    assert returns.within(1.0) == pytest.approx(0.010)
    assert returns.within(0.0) == pytest.approx(0.001)
    returns.answered("slow", 3.0)
    returns.arrived("slow", 3.6)  # beyond the active window: not company, not kept
    returns.answered("gone", 3.0)
    returns.forget("gone")  # closed: its next round (if any) is a new start
    returns.arrived("gone", 3.001)
    returns.arrived("s0", 4.0)  # a second arrival with no answer between: nothing to measure
    assert returns.within(1.0) == pytest.approx(0.010)
    for i in range(2 * RETURN_SAMPLES):  # memory is bounded: the latest samples only
        returns.answered("x", 5.0)
        returns.arrived("x", 5.0 + 0.1)
    assert returns.within(0.0) == pytest.approx(0.1)


def test_each_setting_names_its_policy():
    assert [type(policy(h, 0.001)) for h in Hold] == [Company, Cohort, Quorum, Auto]
    assert policy(Hold("cohort"), 0.003) == Cohort(0.003)


class Recorded:
    """The verifier's own policy, its first answer for each queued round kept (the model thread asks it
    again at each arrival; the first answer says whether the round was held)."""

    def __init__(self, inner) -> None:
        self.inner, self.first = inner, {}

    def hold_until(self, w: Waiting) -> float | None:
        until = self.inner.hold_until(w)
        self.first.setdefault(frozenset(w.queued), until is not None)
        return until


def test_on_the_model_thread_a_cohort_does_not_wait_for_another_that_is_drafting(target):
    """a's first round is answered alone (nobody else is active), b's waits for a (no pass has answered b
    yet): two cohorts. Then neither's next round waits for the other's under cohort; under company each
    waits for the other. What is asserted is the policy's decision on the model thread for each queued
    round, not how long it waited."""
    for hold, waits in ((Hold.COHORT, False), (Hold.COMPANY, True)):
        # max_wait within ACTIVE_WINDOW_S (0.5 s): the other session is still active when the next round comes
        verifier = Verifier(target, VerifierLimits(max_context=512), max_batch=8, max_wait_ms=400, hold=hold)
        verifier.hold = recorded = Recorded(verifier.hold)
        with started(verifier):
            for sid in "ab":
                verifier.submit_open(SessionSpec(sid, (5, 6))).result(30)
            decisions, lengths = [], {"a": 2, "b": 2}
            for sid, round_ in (("a", 0), ("b", 0), ("a", 1), ("b", 1)):
                recorded.first.clear()
                result = verifier.submit_round(DraftBlock(sid, round_, lengths[sid], ())).result(30)
                lengths[sid] = result.committed_len
                decisions.append(recorded.first.get(frozenset(sid), False))
        assert decisions[:2] == [False, True], (hold, decisions)  # a alone goes; b waits for a
        assert decisions[2:] == [waits, waits], (hold, decisions)


def test_on_the_model_thread_auto_reads_the_pass_model_s_fixed_part_and_how_soon_edges_came_back(target):
    """An edge sends its next round 30 ms after each answer, and every pass lasts 100 ms: the return the
    policy is told is the 30 ms from answer to round (not the 130 ms between rounds), and the fixed part is
    the pass model's at that moment."""
    verifier = Verifier(target, VerifierLimits(max_context=512), max_batch=8, max_wait_ms=5, hold=Hold.AUTO)
    forward = verifier.engine.forward

    def slow(feeds):
        time.sleep(0.1)
        return forward(feeds)

    verifier.engine.forward = slow
    seen: list[tuple[Waiting, float]] = []  # what the policy was told, and the pass model's fixed part then

    class Spy:
        def hold_until(self, w: Waiting) -> float | None:
            seen.append((w, verifier.pass_time.coef[0]))
            return verifier_policy.hold_until(w)

    verifier_policy, verifier.hold = verifier.hold, Spy()
    with started(verifier):
        length = verifier.submit_open(SessionSpec("a", (5, 6))).result(30).committed_len
        for round_ in range(4):
            length = verifier.submit_round(DraftBlock("a", round_, length, ())).result(30).committed_len
            time.sleep(0.03)
    assert isinstance(verifier_policy, Auto)
    measured = [w.return_s for w, _ in seen if w.return_s < math.inf]
    assert len(measured) == 2, measured  # a round's return is kept once a pass takes it: rounds 2 and 3 know 1's
    assert all(0.03 <= r < 0.08 for r in measured), measured
    assert all(w.fixed_s == fixed_ms / 1e3 for w, fixed_ms in seen)
    assert seen[-1][0].fixed_s > 0.05  # passes of 100 ms: most of it is what any pass costs
