"""Batched verification: many sessions in one pass give exactly the unbatched answers; batching on the
model thread (waiting for company, pacing prompts); the KV pool's bounds (LRU eviction,
RESOURCE_EXHAUSTED)."""
import random
import threading
from concurrent.futures import wait
import time

import pytest

from conftest import EVENT_TIMEOUT_S, eventually, started
from hybridspec.cloud.core.passes import COST_SMOOTHING, MIN_PREFILL_CHUNK, StepCost, prefill_tokens
from hybridspec.cloud.core.verifier import ACTIVE_WINDOW_S, Verifier, VerifierLimits
from hybridspec.cloud.engine.torch_engine import engine_for
from hybridspec.common.protocol.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from hybridspec.common.protocol.wire import DraftBlock, Mode, SamplingParams, SessionSpec, VerifyResult


def sessions(rng: random.Random, n: int) -> list[SessionSpec]:
    specs = []
    for i in range(n):
        prompt = tuple(rng.randrange(4, 256) for _ in range(rng.randint(1, 40)))
        mode = [Mode.GREEDY, Mode.BILD][i % 2]
        specs.append(SessionSpec(session_id=f"s{i}", committed_ids=prompt, mode=mode, sampling=SamplingParams(),
                                 rollback_threshold=4.0))
    return specs


def drive(verifier: Verifier, specs, rounds: int, rng: random.Random, batched: bool):
    """Run `rounds` rounds of random drafts for every session; returns every result in order."""
    committed = {s.session_id: verifier.open_session(s).committed_len for s in specs}
    history = []
    for r in range(rounds):
        blocks = [DraftBlock(s.session_id, r, committed[s.session_id],
                             tuple(rng.randrange(4, 256) for _ in range(rng.randint(0, 6)))) for s in specs]
        results = verifier.verify_batch(blocks) if batched else [verifier.verify(b) for b in blocks]
        for block, result in zip(blocks, results):
            committed[block.session_id] = result.committed_len
            history.append((result.num_accepted, result.next_token, result.committed_len))
    return history


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_rounds_match_unbatched_rounds_exactly(target, seed):
    limits = VerifierLimits(max_context=512, max_draft=16, max_sessions=16)
    specs = sessions(random.Random(seed), 6)
    alone = drive(Verifier(target, limits), specs, 5, random.Random(seed + 100), batched=False)
    together = drive(Verifier(target, limits), specs, 5, random.Random(seed + 100), batched=True)
    assert together == alone


def test_one_bad_block_does_not_fail_the_batch(target):
    verifier = Verifier(target, VerifierLimits(max_context=512, max_draft=4))
    verifier.open_session(SessionSpec("good", (5, 6)))
    verifier.open_session(SessionSpec("bad", (5, 6)))
    good, bad, unknown = verifier.verify_batch([DraftBlock("good", 0, 2, (7,)), DraftBlock("bad", 0, 2, (7,) * 9),
                                                DraftBlock("nobody", 0, 2, ())])
    assert good.committed_len >= 3
    assert isinstance(bad, InvalidArgument) and "at most 4" in str(bad)
    assert isinstance(unknown, FailedPrecondition)


def test_two_rounds_of_one_session_in_one_batch_run_in_order(target):
    verifier = Verifier(target, VerifierLimits(max_context=512))
    verifier.open_session(SessionSpec("s", (5, 6)))
    first, second = verifier.verify_batch([DraftBlock("s", 0, 2, ()), DraftBlock("s", 1, 3, ())])
    assert (first.committed_len, second.committed_len) == (3, 4)


def test_prompt_chunks_in_a_round_step_change_no_round(target):
    """Continuous batching: rounds that share their forward passes with another session's prompt
    chunks give exactly the answers they give alone."""
    limits = VerifierLimits(max_context=512, max_draft=16, max_sessions=16, prefill_chunk=7)
    specs = sessions(random.Random(5), 3)
    alone = drive(Verifier(target, limits), specs, 4, random.Random(9), batched=False)
    verifier = Verifier(target, limits)
    committed = {s.session_id: verifier.open_session(s).committed_len for s in specs}
    rng, history = random.Random(9), []
    opening = verifier.submit_open(SessionSpec("long", tuple(range(4, 200))))
    fed = verifier.telemetry.iteration_tokens
    before, round_tokens = fed.snapshot().total, 0
    for r in range(4):
        blocks = [DraftBlock(s.session_id, r, committed[s.session_id],
                             tuple(rng.randrange(4, 256) for _ in range(rng.randint(0, 6)))) for s in specs]
        for block, result in zip(blocks, verifier.verify_batch(blocks)):
            committed[block.session_id] = result.committed_len
            history.append((result.num_accepted, result.next_token, result.committed_len))
        round_tokens += sum(len(block.draft_ids) + 1 for block in blocks)
    assert history == alone
    assert fed.snapshot().total - before == round_tokens + 4 * 7  # one chunk rode along with each step
    assert not opening.done() and verifier.wait(opening).committed_len == 196


def served(target, max_wait_ms: float = 200, **limits) -> Verifier:
    """A verifier for the model thread's batching (start it with `started`)."""
    return Verifier(target, VerifierLimits(max_context=512, **limits), max_batch=8, max_wait_ms=max_wait_ms)


# A wait for company longer than any test's bounded wait: a round that waits for company it should not
# is then never answered within EVENT_TIMEOUT_S, where a short max_wait would only make it late.
WAIT_FOREVER_MS = 1e3 * 10 * EVENT_TIMEOUT_S


def test_the_model_thread_groups_rounds_of_active_sessions(target):
    with started(served(target)) as verifier:
        for i in range(8):
            assert verifier.submit_open(SessionSpec(f"c{i}", (5, 6 + i))).result(30).committed_len == 2
        # A first round each makes all eight sessions active...
        firsts = [verifier.submit_round(DraftBlock(f"c{i}", 0, 2, (9,))) for i in range(8)]
        lengths = [f.result(30).committed_len for f in firsts]
        # ...so the next rounds wait (up to max_wait) for each other and share one pass.
        seconds = [verifier.submit_round(DraftBlock(f"c{i}", 1, lengths[i], (9, 9))) for i in range(8)]
        results = [f.result(30) for f in seconds]
        assert [r.batch_size for r in results] == [8] * 8
        assert all(r.verify_ms >= r.queue_ms >= 0 for r in results)


def test_a_lone_round_does_not_wait_for_company(target):
    with started(served(target, WAIT_FOREVER_MS)) as verifier:
        verifier.submit_open(SessionSpec("solo", (5, 6))).result(30)
        assert verifier.submit_round(DraftBlock("solo", 0, 2, ())).result(EVENT_TIMEOUT_S).committed_len == 3


def test_a_closed_session_is_no_company_to_wait_for(target):
    """Regression: a closed session stayed 'recently active' for half a second, so the rounds of the
    session after it (a cloud-only stream after the last, an edge's next generation) each waited
    max_wait for a round that would never come."""
    with started(served(target, WAIT_FOREVER_MS)) as verifier:
        for sid in ("before", "after"):
            verifier.submit_open(SessionSpec(sid, (5, 6))).result(30)
        verifier.submit_round(DraftBlock("before", 0, 2, ())).result(30)
        assert verifier.close_session("before")
        assert verifier.submit_round(DraftBlock("after", 0, 2, ())).result(EVENT_TIMEOUT_S).committed_len == 3


def test_the_model_thread_answers_the_domain_error(target):
    with started(served(target)) as verifier:
        result = verifier.submit_round(DraftBlock("ghost", 0, 1, ())).result(30)
        assert isinstance(result, FailedPrecondition) and "unknown" in str(result)


def prefilling(pool) -> None:
    """Until a prompt's first chunk has taken pages of the KV pool."""
    eventually(lambda: pool.free_tokens < pool.capacity_tokens, "the prefill started")


def test_rounds_run_between_the_chunks_of_a_long_prefill(target):
    with started(served(target, max_draft=16, prefill_chunk=4)) as verifier:
        verifier.submit_open(SessionSpec("short", (5, 6))).result(30)
        long_open = verifier.submit_open(SessionSpec("long", tuple(range(4, 254)) * 2))  # 500 tokens, 125 chunks
        prefilling(verifier.engine.pool)
        for r in range(3):
            result = verifier.submit_round(DraftBlock("short", r, 2 + r, ())).result(30)
            assert isinstance(result, VerifyResult) and result.committed_len == 3 + r
        assert not long_open.done()  # with one lock for the whole prefill the rounds came after it
        assert long_open.result(60).committed_len == 500


def test_an_abandoned_open_gives_its_pages_back(target):
    verifier = served(target, prefill_chunk=1, kv_cache_tokens=1024)
    pool = verifier.engine.pool
    with started(verifier):
        opening = verifier.submit_open(SessionSpec("long", tuple(range(4, 254)) * 2))
        prefilling(pool)
        assert opening.cancel()
        eventually(lambda: pool.free_tokens == pool.capacity_tokens, "the abandoned open's pages back")


def test_a_stop_mid_prefill_gives_the_opens_pages_back(target):
    """Found while merging the scheduler into the verifier: stopping the model thread answered an open
    still being prefilled with UNAVAILABLE but kept the pages its chunks had filled, for as long as the
    verifier lived on (blocking callers use it after its front door stops)."""
    verifier = served(target, prefill_chunk=1, kv_cache_tokens=1024)
    pool = verifier.engine.pool
    with started(verifier):
        opening = verifier.submit_open(SessionSpec("long", tuple(range(4, 254)) * 2))
        prefilling(pool)  # some of the prompt is cached
    assert isinstance(opening.result(0), Unavailable)
    assert pool.free_tokens == pool.capacity_tokens


def test_lru_session_is_evicted_when_the_kv_pool_is_full(target):
    verifier = Verifier(target, VerifierLimits(max_context=512, kv_cache_tokens=48))  # three pages of 16
    verifier.open_session(SessionSpec("old", tuple([5] * 30)))  # 29 cached tokens: two pages
    verifier.open_session(SessionSpec("new", tuple([6] * 30)))  # needs two more: "old" goes
    assert verifier.stats().evictions == 1
    with pytest.raises(FailedPrecondition, match="evicted"):
        verifier.verify(DraftBlock("old", 0, 30, ()))
    assert verifier.verify(DraftBlock("new", 0, 30, ())).committed_len == 31


def test_a_block_that_cannot_fit_is_resource_exhausted_and_changes_nothing(target):
    verifier = Verifier(target, VerifierLimits(max_context=512, max_draft=32, kv_cache_tokens=32))
    verifier.open_session(SessionSpec("s", tuple([5] * 20)))  # 19 cached: two pages, the whole pool
    with pytest.raises(ResourceExhausted, match="no room for this round.s 17 tokens"):
        verifier.verify(DraftBlock("s", 0, 20, (7,) * 16))
    assert verifier.verify(DraftBlock("s", 0, 20, (7,) * 4)).committed_len >= 21  # 24 tokens still fit


def test_memory_never_grows_past_the_pool(target):
    verifier = Verifier(target, VerifierLimits(max_context=512, max_sessions=64, kv_cache_tokens=256))
    for i in range(40):
        verifier.open_session(SessionSpec(f"s{i}", tuple(range(4, 60))))
    stats = verifier.stats()
    assert stats.cached_tokens <= stats.kv_capacity_tokens == 256 and stats.evictions >= 36


def test_a_refused_open_leaves_the_model_thread_idle(target):
    """Found while building the scheduler: an open refused at admission stayed queued and the model
    thread spun on it forever."""
    verifier = served(target, max_sessions=1)
    steps, step = [], verifier.step

    def counted() -> bool:
        steps.append(None)
        return step()

    verifier.step = counted  # the model thread's loop calls self.step()
    with started(verifier):
        verifier.submit_open(SessionSpec("a", (5, 6))).result(30)
        refused = verifier.submit_open(SessionSpec("b", (5, 6))).result(30)
        assert isinstance(refused, ResourceExhausted)
        verifier.submit_call(lambda: None).result(30)
        before = len(steps)
        verifier.submit_call(lambda: None).result(30)
        # One step for one call: with work stuck in a queue, the thread steps on and on meanwhile.
        assert len(steps) - before == 1


def slow_engine(target, seconds: float, max_context: int = 512):
    """The real torch engine, each pass taking `seconds` longer, as a big target's would: the model
    thread's timing is under test."""
    engine = engine_for(target.model, VerifierLimits().kv_cache_tokens, max_context)
    forward = engine.forward

    def slow(feeds):
        time.sleep(seconds)
        return forward(feeds)

    engine.forward = slow
    return engine


def test_sessions_answered_by_a_step_rejoin_the_next_one(target):
    """Found by 92253c5:bench/pool_throughput.py: a round queued during a step made the next step start at
    once, without the sessions that step had just answered, so unsynchronised edges split into small
    batches (8 edges: 107 instead of 138 verified tokens/s). The wait for company runs from the moment
    the model is free: here the a+b step is held (as a big target's pass would last) until the late
    round's max_wait, counted from its arrival, is over; a and b then have max_wait to send again.
    Both fit in ACTIVE_WINDOW_S, after which a and b would no longer count as company."""
    max_wait_s = ACTIVE_WINDOW_S / 2.5  # the edges' round trip must fit in it: as long as the window allows
    engine = engine_for(target.model, VerifierLimits().kv_cache_tokens, 512)
    forward, in_pass, go = engine.forward, threading.Event(), threading.Event()
    go.set()

    def held(feeds):
        in_pass.set()
        assert go.wait(EVENT_TIMEOUT_S)
        return forward(feeds)

    engine.forward = held
    verifier = Verifier(target, VerifierLimits(max_context=512), engine, max_batch=8, max_wait_ms=1e3 * max_wait_s)
    with started(verifier):
        for sid in "abc":
            verifier.submit_open(SessionSpec(sid, (5, 6))).result(30)
        go.clear()
        in_pass.clear()
        entered, hold = threading.Event(), threading.Event()
        verifier.submit_call(lambda: (entered.set(), hold.wait(EVENT_TIMEOUT_S)))  # a and b queue together
        assert entered.wait(EVENT_TIMEOUT_S)
        first = [verifier.submit_round(DraftBlock(sid, 0, 2, ())) for sid in "ab"]
        hold.set()
        assert in_pass.wait(EVENT_TIMEOUT_S)
        late = verifier.submit_round(DraftBlock("c", 0, 2, ()))  # queued while the a+b step runs
        time.sleep(1.25 * max_wait_s)  # the step outlasts c's max_wait (the schedule under test, not a wait)
        go.set()
        assert [f.result(30).batch_size for f in first] == [2, 2]
        again = [verifier.submit_round(DraftBlock(sid, 1, 3, ())) for sid in "ab"]
        assert late.result(30).batch_size == 3
        assert [f.result(30).batch_size for f in again] == [3, 3]


def test_while_others_wait_a_long_prompt_is_fed_by_the_time_budget(target):
    """Found by a prober: with 128-token chunks a 4,000-token prompt held every other session's round
    for a whole chunk (1.6 s on a slow core). While others send rounds, a step now carries what the
    time budget allows (here the floor, MIN_PREFILL_CHUNK); with nobody else, whole chunks."""
    verifier = Verifier(target, VerifierLimits(max_context=1024, prefill_chunk=128), max_batch=8, max_wait_ms=0,
                        prefill_budget_ms=1e-6)
    with started(verifier):
        verifier.submit_open(SessionSpec("short", (5, 6))).result(30)
        long_open = verifier.submit_open(SessionSpec("long", tuple(range(4, 254)) * 2))  # 500 tokens
        for r in range(5):  # a few floor-sized steps of prompt between the rounds
            assert verifier.submit_round(DraftBlock("short", r, 2 + r, ())).result(30).committed_len == 3 + r
        assert not long_open.done()  # 5 steps of 128 tokens would have fed it whole
        assert long_open.result(60).committed_len == 500
        assert verifier.close_session("short")  # nobody else: whole chunks again
        passes = verifier.telemetry.iteration_tokens.snapshot().count
        alone = verifier.submit_open(SessionSpec("alone", tuple(range(5, 255)) * 2))  # no prefix of long's
        assert alone.result(60).committed_len == 500
        assert verifier.telemetry.iteration_tokens.snapshot().count - passes == 4  # 128 x 4 (the floor: 125)


@pytest.mark.parametrize("budget_ms,ms_per_token,rounds,others,fed_last,want", [
    (60.0, 2.0, 0, False, True, 128),  # nobody waits: a whole chunk
    (60.0, 2.0, 5, True, True, 0),  # the prompt advanced last step: this one is the rounds'
    (60.0, 2.0, 5, True, False, 25),  # its turn again: what the round leaves of the budget (30 - 5)
    (60.0, 2.0, 0, True, True, 30),  # a step of prompt alone fills the budget
    (60.0, None, 0, True, False, MIN_PREFILL_CHUNK),  # nothing measured yet: the floor
    (60.0, 20.0, 0, True, False, MIN_PREFILL_CHUNK),  # a slow machine or a deep prompt: the floor, never 0
    (1e4, 0.1, 0, True, False, 128),  # a fast machine: never past prefill_chunk
])
def test_prefill_tokens_fill_what_the_rounds_leave_of_the_budget(budget_ms, ms_per_token, rounds, others, fed_last,
                                                                  want):
    assert prefill_tokens(budget_ms, ms_per_token, rounds, 128, others, fed_last) == want


def test_step_cost_is_a_running_mean_per_token():
    cost = StepCost()
    cost.observe(0.0, 0)
    assert cost.ms_per_token is None
    cost.observe(0.100, 50)
    assert cost.ms_per_token == pytest.approx(2.0)
    cost.observe(0.100, 25)
    assert cost.ms_per_token == pytest.approx(2.0 + COST_SMOOTHING * 2.0)


def test_no_submission_is_lost_while_the_model_thread_takes_its_queues(target):
    """Found by `92253c5:bench/stalls.py refusals` (a prober's one 30 s stall in 1,248 calls): `_put` was handed the
    queue object before taking the lock, so a submission that waited for the lock while the model
    thread swapped that queue for a new one went into the old queue and was never answered."""
    with started(served(target)) as verifier:
        verifier.submit_open(SessionSpec("s", (5, 6))).result(30)
        futures: list = []
        lock = threading.Lock()

        def submit(n: int) -> None:
            mine = [verifier.submit_call(lambda: 1) for _ in range(n)]
            with lock:
                futures.extend(mine)

        threads = [threading.Thread(target=submit, args=(3000,)) for _ in range(4)]
        for t in threads:
            t.start()
        for r in range(30):  # rounds and closes swap the other queues meanwhile
            assert verifier.submit_round(DraftBlock("s", r, 2 + r, ())).result(30).round == r
        for t in threads:
            t.join()
        done, lost = wait(futures, timeout=30)
        assert len(lost) == 0 and all(f.result() == 1 for f in done)


def test_blocking_callers_on_many_threads_step_one_at_a_time(target):
    """Without a model thread, each blocking caller steps for itself; callers on several threads take
    turns (one steps, the others wait for it or for their answer), and every answer is the one a
    caller alone would get."""
    limits = VerifierLimits(max_context=512)
    alone = Verifier(target, limits)
    shared = Verifier(target, limits)
    prompts = {f"t{i}": (5 + i, 6, 7) for i in range(4)}
    expected = {}
    for sid, prompt in prompts.items():
        alone.open_session(SessionSpec(sid, prompt))
        expected[sid] = [alone.verify(DraftBlock(sid, r, 3 + r, ())).next_token for r in range(6)]
    got: dict[str, list[int]] = {}

    def generate(sid: str) -> None:
        shared.open_session(SessionSpec(sid, prompts[sid]))
        got[sid] = [shared.verify(DraftBlock(sid, r, 3 + r, ())).next_token for r in range(6)]

    threads = [threading.Thread(target=generate, args=(sid,)) for sid in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == expected and shared._driver is None


def test_a_one_token_reopen_in_a_round_step_fails_no_round(target):
    """A re-open of a session whose prompt is one token (nothing to prefill), in the same step as a
    round of that session: the round still scores against the session it was admitted for, and the
    other sessions' rounds in the step are untouched. (It used to replace the session, freeing the
    KV pages the round's feed was about to read, before the forward pass: INTERNAL for every round.)"""
    verifier = Verifier(target, VerifierLimits(max_context=512))
    verifier.open_session(SessionSpec("victim", (6, 7, 8)))
    verifier.open_session(SessionSpec("x", (5,)))
    alone = Verifier(target, VerifierLimits(max_context=512))
    alone.open_session(SessionSpec("victim", (6, 7, 8)))
    expected = alone.verify(DraftBlock("victim", 0, 3, (10,)))
    reopen = verifier.submit_open(SessionSpec("x", (5,)))  # admitted in the same step as the rounds
    x_round, victim_round = verifier.verify_batch([DraftBlock("x", 0, 1, (9,)), DraftBlock("victim", 0, 3, (10,))])
    assert isinstance(x_round, VerifyResult), x_round
    assert (victim_round.num_accepted, victim_round.next_token) == (expected.num_accepted, expected.next_token)
    assert verifier.wait(reopen).committed_len == 1 and verifier.stats().sessions == 2
    # The re-open replaced x: its next round is round 0 again, on the one-token prompt.
    assert verifier.verify(DraftBlock("x", 0, 1, ())).committed_len == 2
