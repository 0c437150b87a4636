"""What a pass carries is decided once, by the scheduler: the verifier runs exactly the pass it is
given (cloud/core/passes.py, cloud/core/scheduler.py `schedule`, cloud/core/verifier.py `step`)."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest

from hybridspec.cloud.core.passes import Pass, plan_pass
from hybridspec.cloud.core.scheduler import Scheduler
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.cloud.engine.torch_engine import engine_for
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec, VerifyResult

LIMITS = VerifierLimits(max_context=512, max_draft=8, max_sessions=8, max_tree_nodes=16, kv_cache_tokens=4096)


class Recording(Verifier):
    """The real verifier, keeping every pass it is asked to run."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.passes: list[Pass] = []

    def step(self, work: Pass):
        self.passes.append(work)
        return super().step(work)


def limited_engine(target, **caps):
    engine = engine_for(target.model, 4096)
    engine.capabilities = replace(engine.capabilities, **caps)
    return engine


def trees(n: int) -> list[DraftBlock]:
    return [DraftBlock(f"s{i}", 0, 20, (40 + i, 50 + i, 60 + i), parents=(-1, -1, 0)) for i in range(n)]


def open_all(verifier: Verifier, n: int) -> None:
    for i in range(n):
        verifier.open_session(SessionSpec(f"s{i}", tuple(range(10 + i, 30 + i))))


def test_the_schedulers_pass_is_what_the_verifier_runs(target):
    """Four tree rounds queued at once on an engine that takes two trees a pass: `schedule` splits
    them, the verifier receives two passes of two trees (never more than fits), and every round is
    answered as it would be alone."""
    verifier = Recording(target, LIMITS, engine=limited_engine(target, max_trees=2))
    alone = Verifier(target, LIMITS)
    open_all(verifier, 4)
    open_all(alone, 4)
    blocks = trees(4)
    expected = [alone.verify(b) for b in blocks]
    verifier.passes.clear()
    scheduler = Scheduler(verifier, max_batch=8, max_wait_ms=2000)
    try:
        scheduler.submit_call(lambda: time.sleep(0.3))  # holds the model thread while all four queue
        futures = [scheduler.submit_round(b) for b in blocks]
        got = [f.result(30) for f in futures]
    finally:
        scheduler.stop()
    assert [[b.session_id for b in p.rounds] for p in verifier.passes] == [["s0", "s1"], ["s2", "s3"]]
    assert all(isinstance(g, VerifyResult) for g in got)
    assert [(g.accepted_path, g.next_token) for g in got] == [(e.accepted_path, e.next_token) for e in expected]
    assert [g.batch_size for g in got] == [2, 2, 2, 2]
    # The rounds the engine's limits held back went at once, not after a wait for company (2 s).
    assert got[2].queue_ms - got[0].queue_ms < 1000


def test_a_pass_beyond_the_engines_limits_is_refused_whole(target):
    """The verifier never re-splits: a pass with more trees than the engine takes is a planning bug,
    refused before any session changes (the same rounds then run when planned)."""
    verifier = Verifier(target, LIMITS, engine=limited_engine(target, max_trees=2))
    open_all(verifier, 3)
    blocks = trees(3)
    with pytest.raises(ValueError, match="limits"):
        verifier.step(Pass(tuple(blocks)))
    results = verifier.verify_batch(blocks)  # planned: two passes
    assert [r.batch_size for r in results] == [2, 2, 1]


def test_a_pass_carries_one_round_per_session():
    with pytest.raises(ValueError, match="one round per session"):
        Pass((DraftBlock("a", 0, 2, ()), DraftBlock("a", 1, 3, ())))


def test_plan_pass_fits_the_engine_and_keeps_the_rest_in_order(target):
    """Sessions per pass: an opening keeps one of them while rounds fill the rest; a session's second
    round and rounds past max_rounds wait; what the engine's limits left goes first next time."""
    caps = replace(engine_for(target.model, 256).capabilities, max_sequences_per_pass=3)
    blocks = [DraftBlock("a", 0, 2, ()), DraftBlock("a", 1, 3, ()), DraftBlock("b", 0, 2, ()),
              DraftBlock("c", 0, 2, ()), DraftBlock("d", 0, 2, ())]
    plan = plan_pass(blocks, [], lambda tokens: 0, caps, max_rounds=4)
    assert [b.session_id for b in plan.work.rounds] == ["a", "b", "c"]
    assert (plan.taken, plan.split, plan.waiting) == ([0, 2, 3], [4], [1])
    assert plan.work.keep == {"a", "b", "c", "d"}
    capped = plan_pass(blocks, [], lambda tokens: 0, caps, max_rounds=2)
    assert (capped.taken, capped.split, capped.waiting) == ([0, 2], [], [1, 3, 4])


def test_verify_ms_is_the_schedulers(target):
    """The verifier leaves timing to the scheduler, which times a round from its arrival to its answer."""
    verifier = Verifier(target, LIMITS)
    open_all(verifier, 2)
    assert verifier.verify(DraftBlock("s0", 0, 20, (7,))).verify_ms == 0.0
    scheduler = Scheduler(verifier, max_wait_ms=0)
    try:
        result = scheduler.submit_round(DraftBlock("s1", 0, 20, (7,))).result(30)
    finally:
        scheduler.stop()
    assert result.verify_ms > 0 and result.verify_ms >= result.queue_ms >= 0
