"""A prefix computed once (cloud/core/prefixes.py): a new session whose prompt begins with tokens a
live or recently closed session cached starts from their keys and values, and then verifies exactly
as a session that prefilled its whole prompt (both engines; chains and trees; greedy and sampled); only
within its identity unless the operator shares across identities; bounded, least recently used out."""
from __future__ import annotations

import random

import pytest

from conftest import random_ids, require_embedded
from hybridspec.cloud.core.prefixes import MIN_PREFIX_TOKENS, PrefixCache, Source
from hybridspec.cloud.core.verifier import Verifier
from hybridspec.cloud.core.limits import PrefixScope, VerifierLimits
from hybridspec.common.protocol.wire import DraftBlock, FeatureFormat, Mode, SamplingParams, SessionSpec

LIMITS = VerifierLimits(max_context=512, max_draft=8, max_sessions=8, max_tree_nodes=16, kv_cache_tokens=4096)


class Handle:
    """A stand-in KV handle for the pure cache tests: only its length matters."""

    def __init__(self, length: int) -> None:
        self.length = length


def test_the_longest_prefix_in_the_callers_scope_is_found():
    released = []
    cache = PrefixCache(PrefixScope.IDENTITY, 1000, released.append)
    a, b, kept = Handle(40), Handle(30), Handle(60)
    cache.keep(list(range(100, 160)), kept, "alice")
    live = [Source(list(range(100, 140)), a, "alice"), Source(list(range(100, 125)) + [7] * 5, b, "alice")]
    prompt = list(range(100, 150))
    assert cache.find(prompt, "alice", live) == (kept, 50)  # the closed session holds the longest
    assert cache.find(prompt, "bob", live) is None  # another identity's tokens are not its to reuse
    assert cache.find(prompt[:MIN_PREFIX_TOKENS - 1] + [1], "alice", live) is None  # too short to bother
    shared = PrefixCache(PrefixScope.SHARED, 1000, released.append)
    shared.keep(list(range(100, 160)), kept, "alice")
    assert shared.find(prompt, "bob", []) == (kept, 50)  # the operator's choice
    off = PrefixCache(PrefixScope.OFF, 1000, released.append)
    off.keep(list(range(100, 160)), (dropped := Handle(60)), "alice")
    assert off.find(prompt, "alice", live) is None and released == [dropped]


def test_kept_caches_are_bounded_least_recently_used_out():
    released = []
    cache = PrefixCache(PrefixScope.IDENTITY, 100, released.append)
    first, second, third = Handle(40), Handle(40), Handle(40)
    cache.keep([1] * 40, first, "")
    cache.keep([2] * 40, second, "")
    assert cache.find([1] * 40, "", []) == (first, 40)  # used: now the most recent
    cache.keep([3] * 40, third, "")  # 120 > 100: the least recently used (second) goes
    assert released == [second] and cache.stats().kept_tokens == 80
    assert not cache.drop_oldest(spare=None) or released == [second, first]
    cache.keep([4] * 200, big := Handle(200), "")  # longer than the whole budget: released at once
    assert released[-1] is big


def open_and_decode(verifier: Verifier, sid: str, prompt: list[int], rounds: list[tuple[tuple, tuple]],
                    mode: Mode = Mode.GREEDY, owner: str = "") -> list[tuple]:
    """Open a session and verify `rounds` of (drafts, parents) on it; the verdicts."""
    sampling = SamplingParams() if mode is Mode.GREEDY else SamplingParams(temperature=0.8)
    verifier.open_session(SessionSpec(sid, tuple(prompt), sampling=sampling, mode=mode, seed=7, owner=owner))
    length, verdicts = len(prompt), []
    for r, (drafts, parents) in enumerate(rounds):
        result = verifier.verify(DraftBlock(sid, r, length, drafts, parents=parents, owner=owner))
        verdicts.append((result.num_accepted, result.next_token, result.accepted_path))
        length = result.committed_len
    return verdicts


def rounds_of(seed: int, vocab: int, trees: bool) -> list[tuple[tuple, tuple]]:
    rng = random.Random(seed)
    out = []
    for r in range(6):
        if trees and r % 2:
            out.append(((rng.randrange(4, vocab), rng.randrange(4, vocab), rng.randrange(4, vocab)), (-1, -1, 0)))
        else:
            out.append((tuple(rng.randrange(4, vocab) for _ in range(3)), ()))
    return out


def check_reuse_is_exact(make_verifier, vocab: int, shared: list[int], trees: bool, mode: Mode) -> None:
    """A session started from another's prefix verifies as one that prefilled its whole prompt."""
    prompt = shared + random_ids(2, 25)
    rounds = rounds_of(3, vocab, trees)
    cold = open_and_decode(make_verifier(), "cold", [t % vocab for t in prompt], rounds, mode)
    warm = make_verifier()
    open_and_decode(warm, "first", [t % vocab for t in shared + random_ids(4, 30)], rounds_of(5, vocab, trees), mode)
    assert open_and_decode(warm, "second", [t % vocab for t in prompt], rounds, mode) == cold
    stats = warm.stats().prefixes
    assert (stats.hits, stats.tokens_saved) == (1, len(shared))


@pytest.mark.parametrize("trees", [False, True])
@pytest.mark.parametrize("mode", [Mode.GREEDY, Mode.COUPLED])
def test_torch_reuse_is_exact(target, trees, mode):
    check_reuse_is_exact(lambda: Verifier(target, LIMITS), 256, random_ids(1, 90), trees, mode)


@pytest.mark.embedded
@pytest.mark.slow
@pytest.mark.parametrize("trees,mode", [(False, Mode.GREEDY), (True, Mode.COUPLED)])
def test_llamacpp_reuse_is_exact(trees, mode, llama_target):
    target, make_engine = llama_target
    check_reuse_is_exact(lambda: Verifier(target, LIMITS, make_engine()), 49152, random_ids(1, 150), trees, mode)


@pytest.fixture(scope="module")
def llama_target():
    require_embedded()
    from hybridspec.cloud.engine.llamacpp_engine import LlamaCppEngine
    from hybridspec.common.models.embedded import default_paths
    from hybridspec.common.models.gguf import GgufTarget, find_gguf

    gguf = find_gguf(default_paths()["target"])
    made = []

    def make_engine():
        made.clear()  # one engine at a time: free the last before loading the next
        made.append(LlamaCppEngine.serving(gguf, LIMITS, 1))
        return made[-1]

    return GgufTarget(str(default_paths()["target"]), gguf, make_engine().vocab_size), make_engine


def test_a_closed_sessions_cache_is_reused_and_dropped_first_when_room_is_needed(target):
    verifier = Verifier(target, VerifierLimits(max_context=512, kv_cache_tokens=256, prefix_cache_tokens=200))
    prompt = random_ids(6, 100)
    prompt = [t % 256 for t in prompt]
    verifier.open_session(SessionSpec("a", tuple(prompt)))
    verifier.close_session("a")
    assert verifier.stats().prefixes.kept_sessions == 1
    verifier.open_session(SessionSpec("b", tuple(prompt[:80] + [9] * 20)))
    assert verifier.stats().prefixes.tokens_saved == 80
    verifier.open_session(SessionSpec("c", tuple([8] * 120)))  # 256 tokens hold b and c, not the kept one
    stats = verifier.stats()
    assert stats.prefixes.kept_sessions == 0 and stats.evictions == 0 and stats.sessions == 2


def test_prefixes_stay_within_an_identity_unless_the_operator_shares_them(target):
    prompt = tuple(t % 256 for t in random_ids(7, 60))
    for scope, hits in ((PrefixScope.IDENTITY, 0), (PrefixScope.SHARED, 1)):
        verifier = Verifier(target, VerifierLimits(max_context=512, prefix_scope=scope))
        verifier.open_session(SessionSpec("a", prompt, owner="alice"))
        verifier.open_session(SessionSpec("b", prompt, owner="bob"))
        assert verifier.stats().prefixes.hits == hits, scope
    verifier = Verifier(target, VerifierLimits(max_context=512))
    verifier.open_session(SessionSpec("a", prompt, owner="alice"))
    verifier.open_session(SessionSpec("c", prompt, owner="alice"))
    assert verifier.stats().prefixes.hits == 1


def test_a_session_that_wants_features_prefills_its_prompt(target):
    """Its open returns the prompt's features, which only a prefill computes."""
    prompt = tuple(t % 256 for t in random_ids(8, 60))
    verifier = Verifier(target, VerifierLimits(max_context=512))
    verifier.open_session(SessionSpec("a", prompt))
    opened = verifier.open_session(SessionSpec("b", prompt, features=FeatureFormat.FP16))
    assert opened.features is not None and opened.features.count == len(prompt) - 1
    assert verifier.stats().prefixes.hits == 0
