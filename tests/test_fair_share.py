"""Many tenants on one replica (issue 56): each identity gets its weighted share of the passes in measured
time whatever its number of sessions, sessions beyond the streams are served in runs, and the cache is
shared so that nobody within its share is evicted for another. The planner's rules are pure functions
tested without an engine (cloud/core/passes.py); the rest runs a real Verifier on a tiny random target."""
from __future__ import annotations

import itertools
import threading
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import started
from hybridspec.cloud.core import passes
from hybridspec.cloud.core.limits import PrefixScope, VerifierLimits
from hybridspec.cloud.core.passes import (PassTime, Shares, Usage, fair_rounds, plan_pass, stream_rounds)
from hybridspec.cloud.core.verifier import Verifier
from hybridspec.cloud.engine.base import Capabilities
from hybridspec.common.protocol.errors import FailedPrecondition, ResourceExhausted
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec, VerifyResult

CAPS = Capabilities("x", "cpu", "f32", 0)


def shares(tenant, cost=lambda block: 10.0, budget_ms=60.0, usage=None, weight=None, **more) -> Shares:
    return Shares(tenant, weight or {}, usage or {}, frozenset(tenant.values()), budget_ms, cost, **more)


def blocks_of(sessions: list[str]) -> list[DraftBlock]:
    return [DraftBlock(sid, 0, 10, (1, 2, 3)) for sid in sessions]


# ---- the planner, without an engine -----------------------------------------------------------------

def test_an_identity_alone_gets_every_round_the_pass_may_carry():
    tenant = {f"b{i}": "bob" for i in range(12)}
    plan = plan_pass(blocks_of(list(tenant)), [], lambda tokens: 0, CAPS, max_rounds=8, shares=shares(tenant))
    assert len(plan.work.rounds) == 8  # the budget binds only between tenants: nothing is withheld


def test_one_honest_session_goes_first_beside_many_busy_ones_of_another_identity():
    """Seventeen of bob's rounds queued before alice's one: by arrival alice would wait two passes; by
    share her round is in the next pass, beside as much of bob's work as hers and one round more (bob's
    clock may not run ahead of hers: the pass ends rather than make her next round wait)."""
    tenant = {f"b{i}": "bob" for i in range(17)} | {"a": "alice"}
    offered = blocks_of([f"b{i}" for i in range(17)] + ["a"])
    plan = plan_pass(offered, [], lambda tokens: 0, CAPS, max_rounds=16, shares=shares(tenant))
    ran = Counter(tenant[b.session_id] for b in plan.work.rounds)
    assert ran == {"alice": 1, "bob": 2}
    assert sorted(plan.taken + plan.split + plan.waiting) == list(range(len(offered)))
    by_arrival = plan_pass(offered, [], lambda tokens: 0, CAPS, max_rounds=8)  # no shares: as before
    assert "a" not in {b.session_id for b in by_arrival.work.rounds}


def test_the_share_is_of_time_not_of_rounds():
    """Bob's rounds cost three times alice's (long sessions): with equal clocks, a 60 ms pass carries
    alice's three rounds against bob's one."""
    tenant = {"a1": "alice", "a2": "alice", "a3": "alice", "b1": "bob", "b2": "bob"}
    cost = lambda block: 30.0 if block.session_id.startswith("b") else 10.0  # noqa: E731
    now, _ = fair_rounds(list(enumerate(blocks_of(list(tenant)))), shares(tenant, cost, budget_ms=60.0), 16)
    assert Counter(tenant[b.session_id] for _, b in now) == {"alice": 3, "bob": 1}


def test_weights_and_usage_decide_who_goes_first():
    tenant = {"a1": "alice", "a2": "alice", "b1": "bob", "b2": "bob"}
    items = list(enumerate(blocks_of(list(tenant))))
    ahead = shares(tenant, budget_ms=20.0, usage={"alice": 15.0, "bob": 0.0})
    assert [tenant[b.session_id] for _, b in fair_rounds(items, ahead, 16)[0]] == ["bob", "bob"]
    heavy = shares(tenant, budget_ms=30.0, weight={"alice": 2.0})  # alice's rounds move her clock half as far
    assert Counter(tenant[b.session_id] for _, b in fair_rounds(items, heavy, 16)[0]) == {"alice": 2, "bob": 1}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(tenants=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 12), st.floats(1.0, 40.0)), min_size=2,
                        max_size=4),
       budget=st.floats(20.0, 200.0), max_rounds=st.integers(4, 32))
def test_busy_tenants_get_time_in_proportion_to_their_weights(tenants, budget, max_rounds):
    """Whatever the number of sessions and the cost of their rounds: over 300 passes in which every
    session always has a round queued, the time each tenant got over its weight differs from any
    other's by at most one round (the virtual clock's lag), for every tenant that could fill the
    passes on its own."""
    tenant, cost_of, weight = {}, {}, {}
    for t, (w, sessions, cost) in enumerate(tenants):
        weight[f"t{t}"] = float(w)
        for i in range(sessions):
            tenant[f"t{t}-{i}"] = f"t{t}"
            cost_of[f"t{t}-{i}"] = cost
    usage, served = Usage(), Counter()
    offered = blocks_of(list(tenant))
    for _ in range(300):
        plan = plan_pass(offered, [], lambda tokens: 0, CAPS, max_rounds,
                         shares(tenant, lambda b: cost_of[b.session_id], budget, usage.settle(set(weight)), weight))
        for block in plan.work.rounds:
            t = tenant[block.session_id]
            usage.charge(t, cost_of[block.session_id], weight[t])
            served[t] += cost_of[block.session_id]
    demand_ok = [t for t, (w, sessions, cost) in zip(weight, tenants) if sessions * cost >= budget
                 and sessions >= max_rounds * w / sum(weight.values())]
    largest = max(cost / w for w, _, cost in tenants)
    per_weight = [served[t] / weight[t] / 300 for t in demand_ok]  # ms per pass per unit of weight
    for a, b in itertools.combinations(per_weight, 2):
        assert abs(a - b) <= largest / 300 * 2 + 1e-6 * max(a, b)


def test_sessions_beyond_the_streams_wait_for_their_turn_instead_of_churning():
    """Four streams, all held by bob's sessions that keep sending; bob's fifth session waits until a
    holder has had its stream ROTATION_S; alice, under her share of the streams, takes one at once (from
    bob, the tenant over his share), and a free stream goes to whoever waited longest."""
    tenant = {f"b{i}": "bob" for i in range(5)} | {"a": "alice"}
    resident = {f"b{i}": 1.0 for i in range(4)}
    items = list(enumerate(blocks_of(["b0", "b1", "b2", "b3", "b4"])))
    now, waiting = stream_rounds(items, shares(tenant, resident=resident, streams=4, ages=[0.1] * 4 + [5.0]))
    assert [b.session_id for _, b in now] == ["b0", "b1", "b2", "b3"] and [b.session_id for _, b in waiting] == ["b4"]
    turned = stream_rounds(items, shares(tenant, resident={**resident, "b2": passes.ROTATION_S + 1}, streams=4))
    assert {b.session_id for _, b in turned[0]} == {"b0", "b1", "b3", "b4"}  # b2's run is over: it is parked
    with_alice = items + [(5, DraftBlock("a", 0, 10, (1,)))]
    now, waiting = stream_rounds(with_alice, shares(tenant, resident=resident, streams=4))
    assert "a" in {b.session_id for _, b in now} and len(now) == 4  # one of bob's four gave its stream up
    free = stream_rounds(items, shares(tenant, resident={"b0": 1.0}, streams=4))
    assert len(free[0]) == 4 and free[1] == [items[-1]]  # three free streams for the three oldest waiting


def test_pass_time_learns_what_a_token_at_a_long_context_costs():
    """The model fitted to passes of a fixed cost, 10 ms per token and 5 ms per token per thousand
    tokens cached, from passes mixing short and long contexts; it splits a pass's time accordingly."""
    model = PassTime([(1, 12.0), (8, 82.0), (32, 322.0)])  # the start-up curve: 2 + 10 per token
    true = lambda feeds: 2.0 + sum(t * (10 + 5 * c / 1e3) for t, c in feeds)  # noqa: E731
    for feeds in itertools.islice(itertools.cycle([[(5, 100)], [(1, 3000)] * 7, [(5, 100), (1, 3000)],
                                                   [(64, 1000)], [(5, 2000), (5, 400)]]), 200):
        model.observe(feeds, true(feeds))
    assert model.feed_ms(1, 3000) == pytest.approx(25.0, rel=0.05)
    assert model.feed_ms(5, 100) == pytest.approx(52.5, rel=0.05)
    assert model.split([(5, 100), (1, 3000)], 80.0) == pytest.approx([80 * 52.5 / 77.5, 80 * 25 / 77.5], rel=0.05)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 512), st.integers(0, 8192)), min_size=1, max_size=40),
       st.floats(0.1, 500.0), st.integers(1, 60))
def test_the_pass_time_fit_in_plain_floats_solves_as_numpy_does(feeds, ms, passes_seen):
    """`solve` (Gaussian elimination in plain floats, cheaper than numpy's call at 64 feeds a pass) solves
    the model's own systems as well as numpy's LAPACK does, the nearly singular ones of passes all alike
    included (condition numbers up to 1e10, where the two answers may differ as the system cannot tell)."""
    import numpy as np

    model = PassTime([(1, 12.0), (8, 82.0), (32, 322.0)])
    for _ in range(passes_seen):
        model.observe(feeds, ms)
    a, b = np.array(model._gram), np.array(model._moment)
    ours, lapack = np.array(passes.solve(model._gram, model._moment)), np.linalg.solve(a, b)
    assert np.abs(a @ ours - b).max() <= 1e-10 * np.abs(b).max()  # backward stable, as LAPACK's
    if np.linalg.cond(a) < 1e8:  # where the system determines its answer, the same answer
        assert ours.tolist() == pytest.approx(lapack.tolist(), rel=1e-6, abs=1e-9)
    assert passes.solve([[1.0, 2.0], [2.0, 4.0]], [1.0, 2.0]) is None  # singular


def test_a_tenant_that_becomes_active_starts_level_with_the_others():
    """No credit is banked: bob's time alone is not held against him, alice's time away not for her."""
    usage = Usage()
    usage.settle({"bob"})
    usage.charge("bob", 900.0, 1.0)
    assert usage.settle({"bob", "alice"}) == {"bob": 0.0, "alice": 0.0}
    usage.charge("alice", 30.0, 1.0)
    assert usage.settle({"bob", "alice"}) == {"bob": 0.0, "alice": 30.0}
    assert usage.settle({"alice"}) == {"alice": 0.0}


# ---- a real verifier on a tiny target ---------------------------------------------------------------

LIMITS = VerifierLimits(max_context=256, max_draft=8, max_sessions=32, kv_cache_tokens=4096,
                        prefix_scope=PrefixScope.OFF)


def spec(session_id: str, tenant: str, length: int = 20, **fields) -> SessionSpec:
    return SessionSpec(session_id, tuple(range(10, 10 + length)), tenant=tenant, **fields)


def recorded_passes(verifier: Verifier) -> list[list[str]]:
    """The sessions each pass of `verifier`'s engine fed, in order (the real engine runs them)."""
    passes_fed: list[list[str]] = []
    forward = verifier.engine.forward

    def recorded(feeds):
        kv = {id(s.kv): sid for sid in verifier._sessions.ids() if (s := verifier._sessions.find(sid))}
        passes_fed.append([kv.get(id(feed.kv), "?") for feed in feeds])
        return forward(feeds)

    verifier.engine.forward = recorded
    return passes_fed


def test_an_honest_round_is_in_the_next_pass_beside_many_of_another_identity(target):
    """Eight of bob's rounds are queued before alice's one and a pass takes four: by arrival alice's
    round ran in the third pass; by share it runs in the first, and so does one of bob's at least."""
    verifier = Verifier(target, LIMITS, max_batch=4, max_wait_ms=0)
    for i in range(8):
        verifier.open_session(spec(f"bob{i}", "bob"))
    verifier.open_session(spec("alice", "alice"))
    fed = recorded_passes(verifier)
    with started(verifier):
        gate = threading.Event()
        hold = verifier.submit_call(lambda: gate.wait(60))  # the model thread is held while all nine queue
        futures = [verifier.submit_round(DraftBlock(f"bob{i}", 0, 20, (5, 6))) for i in range(8)]
        futures.append(verifier.submit_round(DraftBlock("alice", 0, 20, (5, 6))))
        gate.set()
        hold.result(30)
        results = [f.result(30) for f in futures]
    assert all(isinstance(r, VerifyResult) for r in results)
    first = fed[0]
    assert "alice" in first and any(sid.startswith("bob") for sid in first), fed


def test_an_identity_over_its_share_of_the_cache_evicts_its_own_sessions_first(target):
    """Six pages of 16 tokens. Alice's idle conversation is the least recently used; bob fills the rest
    and opens a third session: it is bob's own oldest session that goes (bob is over half the cache
    with it), never alice's, who is within hers."""
    limits = replace(LIMITS, kv_cache_tokens=96)
    verifier = Verifier(target, limits)
    verifier.open_session(spec("alice", "alice"))
    verifier.open_session(spec("bob0", "bob"))
    verifier.open_session(spec("bob1", "bob"))
    verifier.open_session(spec("bob2", "bob"))
    assert verifier.verify(DraftBlock("alice", 0, 20, (5,))).round == 0
    with pytest.raises(FailedPrecondition, match="evicted"):
        verifier.verify(DraftBlock("bob0", 0, 20, (5,)))
    assert set(verifier.stats().session_ids) == {"alice", "bob1", "bob2"}


def test_an_identity_over_its_share_with_nothing_idle_is_refused_not_served_from_anothers(target):
    """Bob's two sessions are both busy (rounds queued in the same step) and hold more than his share:
    his third open is refused; alice's idle session, within her share, is kept."""
    limits = replace(LIMITS, kv_cache_tokens=96)
    verifier = Verifier(target, limits, max_batch=1)
    verifier.open_session(spec("alice", "alice"))
    verifier.open_session(spec("bob0", "bob"))
    verifier.open_session(spec("bob1", "bob"))
    opening = verifier.submit_open(spec("bob2", "bob"))
    results = verifier.verify_batch([DraftBlock("bob0", 0, 20, ()), DraftBlock("bob1", 0, 20, ())])
    assert all(isinstance(r, VerifyResult) for r in results)
    assert isinstance(opening.result(0), ResourceExhausted)
    assert verifier.verify(DraftBlock("alice", 0, 20, (5,))).round == 0


@pytest.mark.embedded
def test_sessions_beyond_the_streams_are_served_in_runs_not_parked_every_pass(monkeypatch):
    """Two streams and three cloud-only streams decoding at once on llama.cpp. By arrival, every pass
    parked one session and restored another (120 parks for 120 tokens); in runs, a session keeps its
    stream while it is busy, until a holder has had its own for ROTATION_S (longer than this test, so
    that the count does not depend on the machine's speed): the third session gets a stream when one
    of the first two is done, and the parks are at most two. (Turning over after ROTATION_S is
    test_sessions_beyond_the_streams_wait_for_their_turn_instead_of_churning's.)"""
    import asyncio

    from conftest import random_ids, require_embedded

    require_embedded()
    from hybridspec.cloud.engine.llamacpp_engine import LlamaCppEngine
    from hybridspec.common.models.embedded import default_paths
    from hybridspec.common.models.gguf import GgufTarget, find_gguf

    monkeypatch.setattr(passes, "ROTATION_S", 1000.0, raising=False)
    gguf = find_gguf(default_paths()["target"])
    limits = VerifierLimits(max_context=512, kv_streams=2, kv_cache_tokens=4096, max_tree_nodes=0)
    engine = LlamaCppEngine.serving(gguf, limits, 1)
    verifier = Verifier(GgufTarget(str(gguf), gguf, engine.vocab_size), limits, engine, max_wait_ms=0)
    prompts = {f"s{i}": random_ids(70 + i, 40) for i in range(3)}
    for sid, prompt in prompts.items():
        verifier.open_session(SessionSpec(sid, tuple(prompt)))
    parked_before = engine.parks

    async def decode_all() -> dict[str, list[int]]:
        await verifier.start()
        try:
            async def one(sid: str) -> list[int]:
                first = DraftBlock(sid, 0, len(prompts[sid]), ())
                return [token async for token in verifier.adecode(first, 40, frozenset())]

            return dict(zip(prompts, await asyncio.gather(*(one(sid) for sid in prompts))))
        finally:
            await verifier.stop()

    decoded = asyncio.run(decode_all())
    assert all(len(tokens) == 40 for tokens in decoded.values())
    assert engine.parks - parked_before <= 2, engine.parks - parked_before  # 120 tokens over about 60 passes


def test_a_round_within_its_share_is_served_from_a_tenant_over_its_own_even_when_that_one_is_busy(target):
    """Four pages of 16 tokens, all held: alice's session (10 tokens) and bob's three (12 each, over half
    the cache between them). Alice's round needs a second page while bob's three have rounds queued: a
    busy session used to be untouchable, so alice was refused; now bob, over his share, gives up his
    least recently used session (its queued round is told it was evicted) and alice is served."""
    verifier = Verifier(target, replace(LIMITS, kv_cache_tokens=64), max_batch=1)
    verifier.open_session(spec("alice", "alice", length=10))
    for i in range(3):
        verifier.open_session(spec(f"bob{i}", "bob", length=12))
    results = verifier.verify_batch([DraftBlock("alice", 0, 10, tuple(range(30, 37)))]
                                    + [DraftBlock(f"bob{i}", 0, 12, ()) for i in range(3)])
    assert isinstance(results[0], VerifyResult)
    assert isinstance(results[1], FailedPrecondition) and all(isinstance(r, VerifyResult) for r in results[2:])
