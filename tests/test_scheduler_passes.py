"""What a pass carries is decided once, by a pure function (cloud/core/passes.py `plan_pass`), in the
step that runs it (cloud/core/verifier.py `Verifier.step`, its step 2), for the model thread and for a
blocking caller stepping on its own alike."""
from __future__ import annotations

import itertools
import random
import threading
from dataclasses import replace

import pytest

from conftest import EVENT_TIMEOUT_S, started
from hybridspec.cloud.core.passes import Pass, plan_pass
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.cloud.engine.base import Capabilities
from hybridspec.cloud.engine.torch_engine import engine_for
from hybridspec.common.protocol.tree import leaves
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec, VerifyResult

LIMITS = VerifierLimits(max_context=512, max_draft=8, max_sessions=8, max_tree_nodes=16, kv_cache_tokens=4096)


def recording_engine(target, **caps):
    """The real torch engine with `caps` changed, and the number of feeds each of its passes carried."""
    engine = engine_for(target.model, 4096)
    engine.capabilities = replace(engine.capabilities, **caps)
    passes: list[int] = []
    forward = engine.forward

    def recorded(feeds):
        passes.append(len(feeds))
        return forward(feeds)

    engine.forward = recorded
    return engine, passes


def trees(n: int) -> list[DraftBlock]:
    return [DraftBlock(f"s{i}", 0, 20, (40 + i, 50 + i, 60 + i), parents=(-1, -1, 0)) for i in range(n)]


def open_all(verifier: Verifier, n: int) -> None:
    for i in range(n):
        verifier.open_session(SessionSpec(f"s{i}", tuple(range(10 + i, 30 + i))))


def test_the_planned_pass_is_what_the_engine_runs(target):
    """Four tree rounds queued at once on an engine that takes two trees a pass: the plan splits them,
    the engine runs two passes of two trees (never more than fits), and every round is answered as it
    would be alone."""
    engine, passes = recording_engine(target, max_trees=2)
    # A wait for company no bounded wait here outlasts: rounds held back for company never come back.
    verifier = Verifier(target, LIMITS, engine=engine, max_batch=8, max_wait_ms=1e3 * 10 * EVENT_TIMEOUT_S)
    alone = Verifier(target, LIMITS)
    open_all(verifier, 4)
    open_all(alone, 4)
    blocks = trees(4)
    expected = [alone.verify(b) for b in blocks]
    passes.clear()
    with started(verifier):
        entered, hold = threading.Event(), threading.Event()
        verifier.submit_call(lambda: (entered.set(), hold.wait(EVENT_TIMEOUT_S)))  # the model thread, held
        assert entered.wait(EVENT_TIMEOUT_S)
        futures = [verifier.submit_round(b) for b in blocks]  # all four queue meanwhile
        hold.set()
        got = [f.result(EVENT_TIMEOUT_S) for f in futures]
    assert passes == [2, 2]
    assert all(isinstance(g, VerifyResult) for g in got)
    assert [(g.accepted_path, g.next_token) for g in got] == [(e.accepted_path, e.next_token) for e in expected]
    assert [g.batch_size for g in got] == [2, 2, 2, 2]  # and the two held back by the engine's limits went
    # at once: after a wait for company they would not have been answered at all


def test_a_blocking_caller_gets_the_same_planned_passes(target):
    """No second planner: blocks handed to `verify_batch` on a verifier without a model thread are
    planned by the same step, within the engine's limits."""
    engine, passes = recording_engine(target, max_trees=2)
    verifier = Verifier(target, LIMITS, engine=engine)
    open_all(verifier, 3)
    passes.clear()
    results = verifier.verify_batch(trees(3))
    assert passes == [2, 1] and [r.batch_size for r in results] == [2, 2, 1]


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


@pytest.mark.parametrize("seed", range(20))
def test_a_planned_pass_never_asks_more_than_the_engine_may_carry(seed):
    """The step runs the plan as it is, so the planner alone keeps a pass within the engine's limits:
    sessions per pass, trees per pass and leaves per pass; every block offered is placed exactly once."""
    rng = random.Random(seed)
    caps = Capabilities("x", "cpu", "f32", 0, tree_masks=True, max_sequences_per_pass=rng.choice([0, 2, 3, 8]),
                        max_trees=rng.choice([0, 1, 2]), max_tree_leaves=rng.choice([0, 4, 6]))
    blocks = []
    for i in range(rng.randint(0, 12)):
        parents = rng.choice([(), (-1, -1, 0), (-1, 0, 0, -1)])
        blocks.append(DraftBlock(f"s{rng.randint(0, 5)}", i, 2, tuple(range(len(parents) or 2)), parents=parents))
    plan = plan_pass(blocks, [], lambda tokens: 0, caps, max_rounds=rng.randint(1, 10))
    rounds = plan.work.rounds
    if caps.max_sequences_per_pass:
        assert len(rounds) <= caps.max_sequences_per_pass
    tree_rounds = [b for b in rounds if b.is_tree]
    if caps.max_trees and len(tree_rounds) > 1:
        assert len(tree_rounds) <= caps.max_trees
    if caps.max_tree_leaves and len(tree_rounds) > 1:
        assert sum(leaves(b.parents) for b in tree_rounds) <= caps.max_tree_leaves
    placed = sorted(itertools.chain(plan.taken, plan.split, plan.waiting))
    assert placed == list(range(len(blocks))) and [blocks[i] for i in plan.taken] == list(rounds)
    assert bool(blocks) <= bool(rounds)  # something always runs: the queue drains


def test_verify_ms_is_set_where_a_round_is_answered(target):
    """A round is timed by the step that answers it, from its arrival: for a blocking caller stepping on
    its own and on the model thread alike."""
    verifier = Verifier(target, LIMITS, max_wait_ms=0)
    open_all(verifier, 2)
    direct = verifier.verify(DraftBlock("s0", 0, 20, (7,)))
    with started(verifier):
        served = verifier.submit_round(DraftBlock("s1", 0, 20, (7,))).result(30)
    for result in (direct, served):
        assert result.verify_ms > 0 and result.verify_ms >= result.queue_ms >= 0
