"""Batched verification: many sessions in one pass give exactly the unbatched answers; LRU eviction."""
import asyncio
import random

import pytest

from hybridspec.cloud.batcher import RoundBatcher
from hybridspec.cloud.verifier import Verifier, VerifierLimits
from hybridspec.common.errors import FailedPrecondition, InvalidArgument
from hybridspec.common.wire import DraftBlock, Mode, SamplingParams, SessionSpec


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
    committed = {s.session_id: verifier.open_session(s) for s in specs}
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


def test_batcher_groups_concurrent_rounds(target):
    verifier = Verifier(target, VerifierLimits(max_context=512))
    for i in range(8):
        verifier.open_session(SessionSpec(f"c{i}", (5, 6 + i)))

    async def go():
        batcher = RoundBatcher(verifier.verify_batch, max_batch=8, max_wait_ms=200)
        return await asyncio.gather(*(batcher.submit(DraftBlock(f"c{i}", 0, 2, (9, 9))) for i in range(8)))

    results = asyncio.run(go())
    assert [r.batch_size for r in results] == [8] * 8
    assert all(r.verify_ms > 0 for r in results)


def test_batcher_raises_the_domain_error(target):
    verifier = Verifier(target, VerifierLimits(max_context=512))

    async def go():
        return await RoundBatcher(verifier.verify_batch, 4, 1).submit(DraftBlock("ghost", 0, 1, ()))

    with pytest.raises(FailedPrecondition, match="unknown"):
        asyncio.run(go())


def test_lru_session_is_evicted_past_the_token_budget(target):
    verifier = Verifier(target, VerifierLimits(max_context=512, max_cached_tokens=50))
    verifier.open_session(SessionSpec("old", tuple([5] * 30)))
    verifier.open_session(SessionSpec("new", tuple([6] * 30)))  # 60 > 50: "old" goes
    assert verifier.stats().evictions == 1
    with pytest.raises(FailedPrecondition, match="evicted"):
        verifier.verify(DraftBlock("old", 0, 30, ()))
    assert verifier.verify(DraftBlock("new", 0, 30, ())).committed_len == 31
