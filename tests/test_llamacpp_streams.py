"""The llama.cpp engine's memory on the embedded target: a cache that is a function of its tokens
whatever the chunking, sessions beyond the resident streams parked in host memory and restored bit
for bit, the least recently used parked first and never one the coming pass feeds, bounded host
memory, and a new session started from another's cached prefix exactly as if it had prefilled it."""
import mmap

import pytest
import torch

from conftest import random_ids, require_embedded
from hybridspec.cloud.engine.base import Feed
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.gguf import find_gguf
from hybridspec.common.protocol.errors import ResourceExhausted

pytestmark = pytest.mark.embedded

STREAM = 1024


@pytest.fixture(scope="module")
def engine():
    """Two resident streams of 1,024 cells and host memory for 1,500 parked tokens."""
    require_embedded()
    from hybridspec.cloud.engine.llamacpp_engine import LlamaCppEngine

    return LlamaCppEngine(find_gguf(default_paths()["target"]), 2 * STREAM, 2, threads=1, trees=False,
                          parked_tokens=1500)


def prefill(engine, tokens, chunk=256, kv=None):
    kv = kv or engine.new_sequence()
    for start in range(0, len(tokens), chunk):
        engine.reserve(kv, len(tokens[start:start + chunk]))
        engine.forward([Feed(kv, tokens[start:start + chunk], scored=False)])
    return kv


def score(engine, kv, block):
    """The logits of `block` after kv's cache, which is then cut back."""
    engine.reserve(kv, len(block))
    logits = engine.forward([Feed(kv, block, scored=True)])[0].logits
    engine.truncate(kv, kv.length - len(block))
    return logits


@pytest.mark.slow
def test_a_cache_does_not_depend_on_how_its_tokens_were_chunked(engine):
    """Regression: in ubatches of 64 rows or more llama.cpp's flash attention takes a tiled kernel
    that rounds otherwise; a prompt prefilled in chunks of 100 then scored a block with logits up to
    0.94 away from the same prompt prefilled in chunks of 7 (which the scheduler feeds under load)."""
    context, block = random_ids(20, 300), random_ids(21, 4)
    expected = None
    for chunk in (300, 100, 7):
        kv = prefill(engine, context, chunk)
        logits = score(engine, kv, block)
        engine.release(kv)
        expected = logits if expected is None else expected
        assert torch.equal(logits, expected), chunk


@pytest.mark.slow
@pytest.mark.parametrize("huge", [False, True], ids=["bytes", "huge pages"])
def test_a_session_past_the_streams_parks_the_least_recently_used_and_is_restored_exactly(engine, huge,
                                                                                         monkeypatch):
    from hybridspec.cloud.engine import llamacpp_context

    if huge:  # park every state in huge-page memory, as states of over 16 MiB are
        monkeypatch.setattr(llamacpp_context, "HUGE_STATE_BYTES", 0)
    a, b = prefill(engine, random_ids(22, 300)), prefill(engine, random_ids(23, 200))
    block = random_ids(24, 5)
    before = score(engine, a, block), score(engine, b, block)
    parks = engine.parks
    c = prefill(engine, random_ids(25, 100))  # no free stream: a (used least recently) is parked
    assert a.seq_id is None and a.length == 300 and engine.parked_tokens == 300 and engine.parks == parks + 1
    assert isinstance(a.parked, mmap.mmap) == huge
    assert b.seq_id is not None and c.seq_id is not None
    assert torch.equal(score(engine, a, block), before[0])  # restored (b parked now), bit for bit
    assert b.seq_id is None and torch.equal(score(engine, b, block), before[1])
    for kv in (a, b, c):
        engine.release(kv)
    assert engine.parked_tokens == 0 and engine.fill() == 0


def test_no_session_the_coming_pass_feeds_is_parked(engine):
    a, b = prefill(engine, random_ids(26, 50)), prefill(engine, random_ids(27, 50))
    engine.reserve(a, 1)
    engine.reserve(b, 1)  # both are in the coming pass
    c = engine.new_sequence()
    assert not engine.fits(c, 10)
    with pytest.raises(ResourceExhausted):
        engine.reserve(c, 10)
    assert c.seq_id is None and a.seq_id is not None and b.seq_id is not None  # nothing taken, nothing parked
    engine.forward([Feed(a, [5], scored=False), Feed(b, [6], scored=False)])
    assert engine.fits(c, 10)  # after the pass either may go
    for kv in (a, b):
        engine.release(kv)


@pytest.mark.slow
def test_host_memory_for_parked_sessions_is_bounded(engine):
    held = [prefill(engine, random_ids(28 + i, 800)) for i in range(3)]  # the third parks the first
    assert engine.parked_tokens == 800
    # Parking either resident session of 800 would take host memory past 1,500: no room for a fourth.
    assert not engine.fits(engine.new_sequence(), 1)
    engine.release(held[0])
    assert engine.fits(engine.new_sequence(), 1)
    for kv in held[1:]:
        engine.release(kv)
    assert engine.parked_tokens == 0


@pytest.mark.slow
@pytest.mark.parametrize("parked", [False, True])
def test_a_copied_prefix_scores_as_if_prefilled(engine, parked):
    """copy_prefix: a new session from another's first tokens (resident or parked) then holds exactly
    what a prefill of them computes: the same logits, bit for bit, for the rest of its prompt."""
    shared, rest, block = random_ids(31, 230), random_ids(32, 40), random_ids(33, 4)
    cold = prefill(engine, shared + rest)
    expected = score(engine, cold, block)
    engine.release(cold)
    source = prefill(engine, shared + random_ids(34, 70), chunk=33)  # another prompt, other chunks
    if parked:
        others = [prefill(engine, random_ids(35 + i, 20)) for i in range(2)]  # the source is parked
        assert source.seq_id is None
        engine.release(others.pop())
    kv = engine.new_sequence()
    engine.copy_prefix(source, kv, len(shared))
    assert kv.length == len(shared) and source.length == 300
    prefill(engine, rest, kv=kv)
    assert torch.equal(score(engine, kv, block), expected)
    with pytest.raises(ValueError, match="empty"):
        engine.copy_prefix(source, kv, 10)
    for handle in (kv, source, *(others if parked else [])):
        engine.release(handle)
