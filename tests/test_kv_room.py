"""A full replica: an idle session may be parked or evicted to make room (least recently used first), a
busy one never; a new session that finds no room gets RESOURCE_EXHAUSTED; a pass never carries more
sessions than the engine's streams (llama.cpp), the rest waiting for the next pass of the step."""
import pytest

from conftest import random_ids, require_embedded
from hybridspec.cloud.core.passes import opening_sessions, split_rounds
from hybridspec.cloud.core import session as session_module
from hybridspec.cloud.core.session import Session, SessionStore
from hybridspec.cloud.core.verifier import Verifier
from hybridspec.cloud.engine.base import Capabilities
from hybridspec.cloud.core.limits import PrefixScope, VerifierLimits
from hybridspec.common.protocol.errors import FailedPrecondition, ResourceExhausted
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec, VerifyResult


def test_a_busy_session_is_never_evicted_for_a_new_one(target):
    """Three pages of 16: "a" holds two; "b" needs two more. With a's round in the same step, or queued
    for a later one (the pass takes one round: x's), "b" is refused and "a" keeps its cache; once "a"
    is idle it is the one evicted."""
    limits = VerifierLimits(max_context=512, kv_cache_tokens=48, prefix_scope=PrefixScope.OFF)
    for busy in ("in the step", "queued"):
        verifier = Verifier(target, limits, max_batch=1)
        verifier.open_session(SessionSpec("a", tuple([5] * 30)))
        blocks = [DraftBlock("a", 0, 30, ())]
        if busy == "queued":  # x's round takes the pass's one place (and the last page); a's waits its turn
            verifier.open_session(SessionSpec("x", (7,)))
            blocks.insert(0, DraftBlock("x", 0, 1, ()))
        opening = verifier.submit_open(SessionSpec("b", tuple([6] * 30)))
        results = verifier.verify_batch(blocks)
        assert isinstance(opening.result(0), ResourceExhausted), busy
        assert all(isinstance(r, VerifyResult) for r in results)
        stats = verifier.stats()
        assert stats.evictions == 0 and set(stats.session_ids) == {block.session_id for block in blocks}
    verifier.open_session(SessionSpec("b", tuple([6] * 30)))  # "a" is idle now: evicted for it
    with pytest.raises(FailedPrecondition, match="evicted"):
        verifier.verify(DraftBlock("a", 1, 31, ()))


def test_a_pass_carries_at_most_the_engines_sessions_and_keeps_one_for_a_prompt():
    caps = Capabilities("x", "cpu", "f32", 0, max_sequences_per_pass=3)
    rounds = [(i, DraftBlock(f"s{i}", 0, 2, ())) for i in range(5)]
    now, later = split_rounds(rounds, caps, 3)
    assert [i for i, _ in now] == [0, 1, 2] and [i for i, _ in later] == [3, 4]
    prompts = [Session(SessionSpec(f"p{i}", tuple(range(4, 40))), None) for i in range(2)]
    for p in prompts:
        p.kv = type("KV", (), {"length": 0})()
    assert opening_sessions(prompts, 100, rounds=5, limit=3) == 1  # rounds fill the pass: one stream kept
    assert opening_sessions(prompts, 100, rounds=0, limit=3) == 2
    assert opening_sessions(prompts, 20, rounds=0, limit=3) == 1  # the budget reaches the first only
    assert opening_sessions(prompts, 0, rounds=0, limit=3) == 0


@pytest.mark.embedded
@pytest.mark.slow
def test_llamacpp_sessions_beyond_the_streams_are_served_and_parked_exactly():
    """Two streams, three live sessions and a new one: every round is answered (the third waits for
    the pass after), idle sessions are parked and restored, and each session's tokens equal those it
    decodes alone on a fresh engine."""
    require_embedded()
    from hybridspec.cloud.engine.llamacpp_engine import LlamaCppEngine
    from hybridspec.common.models.embedded import default_paths
    from hybridspec.common.models.gguf import GgufTarget, find_gguf

    gguf = find_gguf(default_paths()["target"])
    limits = VerifierLimits(max_context=1024, kv_streams=2, kv_cache_tokens=4096, max_tree_nodes=0)

    def verifier():
        engine = LlamaCppEngine.serving(gguf, limits, 1)
        return Verifier(GgufTarget(str(gguf), gguf, engine.vocab_size), limits, engine), engine

    prompts = {f"s{i}": random_ids(40 + i, 60 + 20 * i) for i in range(3)}
    alone = {}
    for sid, prompt in prompts.items():
        single, _ = verifier()
        single.open_session(SessionSpec(sid, tuple(prompt)))
        alone[sid] = [single.verify(DraftBlock(sid, r, len(prompt) + r, ())).next_token for r in range(4)]
        del single
    shared, engine = verifier()
    for sid, prompt in prompts.items():
        shared.open_session(SessionSpec(sid, tuple(prompt)))
    assert engine.parks >= 1  # three sessions, two streams
    got = {sid: [] for sid in prompts}
    for r in range(4):
        blocks = [DraftBlock(sid, r, len(prompt) + r, ()) for sid, prompt in prompts.items()]
        for block, result in zip(blocks, shared.verify_batch(blocks)):
            got[block.session_id].append(result.next_token)
    assert got == alone and engine.restores >= 4


def test_idle_sessions_expire_in_order_of_last_use_and_a_slow_prefill_is_not_idle(monkeypatch):
    """Expiry reads only the store's stale head (every round's lookup asks): a session counts as used when
    it goes live, so one whose prefill outlasted the timeout is not expired on its first round, and a
    session used since stays while an older one goes."""
    now = [1000.0]
    monkeypatch.setattr(session_module.time, "monotonic", lambda: now[0])
    released = []
    store = SessionStore(max_sessions=8, idle_timeout_s=10, release=released.append)
    slow = Session(SessionSpec("slow", (5, 6)), kv="slow-kv")  # its open starts at 1000
    now[0] = 1005.0
    store.go_live(Session(SessionSpec("a", (5,)), kv="a-kv"))
    now[0] = 1012.0
    store.go_live(slow)  # a 12 s prefill
    now[0] = 1014.0
    assert store.get("a").spec.session_id == "a" and store.ids() == ("slow", "a")
    now[0] = 1023.0
    assert store.expire_idle() == 1 and store.ids() == ("a",) and released == ["slow-kv"]
    now[0] = 1025.0
    with pytest.raises(FailedPrecondition, match="evicted"):
        store.get("a")
    assert released == ["slow-kv", "a-kv"] and store.evictions == 2
