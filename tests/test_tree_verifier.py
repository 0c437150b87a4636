"""Draft trees in the verifier core on the torch engine: one pass scores every node as its root path
would be scored as a chain, only the accepted path's keys stay cached, the rules pick the right path,
and every malformed tree is refused before anything changes."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.cloud.engine.base import Feed
from hybridspec.cloud.engine.torch_engine import TorchEngine, engine_for
from hybridspec.common.protocol.errors import InvalidArgument
from hybridspec.common.protocol.tree import feed_parents, path_to
from hybridspec.common.maths.features import decode_features
from hybridspec.common.protocol.wire import DraftBlock, FeatureFormat, Mode, SamplingParams, SessionSpec

LIMITS = VerifierLimits(max_context=512, max_draft=8, max_sessions=8, max_tree_nodes=16, kv_cache_tokens=4096)


def random_tree(rng: random.Random, nodes: int, depth: int = 4) -> tuple[list[int], list[int]]:
    """(parents, tokens): a random tree with distinct sibling tokens, at most `depth` deep."""
    parents, tokens, level = [], [], []
    for i in range(nodes):
        options = [-1] + [j for j in range(i) if level[j] < depth]
        p = rng.choice(options)
        taken = {tokens[j] for j in range(i) if parents[j] == p}
        tokens.append(rng.choice([t for t in range(4, 256) if t not in taken]))
        parents.append(p)
        level.append(1 if p == -1 else level[p] + 1)
    return parents, tokens


def chain_logits(engine: TorchEngine, context: list[int], path: list[int]) -> torch.Tensor:
    """The logits after context + path, scored the plain way in a fresh sequence."""
    kv = engine.new_sequence()
    engine.reserve(kv, len(context) + len(path))
    (scores,) = engine.forward([Feed(kv, context + path, scored=True)])
    engine.release(kv)
    return scores.logits[-1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_tree_pass_scores_every_node_as_its_root_path(target, seed):
    rng = random.Random(seed)
    engine = engine_for(target.model, 2048)
    context = [rng.randrange(4, 256) for _ in range(rng.randint(1, 30))]
    parents, tokens = random_tree(rng, rng.randint(2, 12))
    kv = engine.new_sequence()
    engine.reserve(kv, len(context) - 1)
    if len(context) > 1:
        engine.forward([Feed(kv, context[:-1], scored=False)])
    fed = [context[-1], *tokens]
    engine.reserve(kv, len(fed))
    (scores,) = engine.forward([Feed(kv, fed, scored=True, parents=feed_parents(parents))])
    for row in range(len(fed)):
        path = [] if row == 0 else [tokens[n] for n in path_to(parents, row - 1)]
        torch.testing.assert_close(scores.logits[row], chain_logits(engine, context, path), atol=1e-4, rtol=1e-4)


def test_after_keep_rows_the_session_continues_as_if_the_path_were_a_chain(target):
    rng = random.Random(5)
    engine = engine_for(target.model, 2048)
    context = [rng.randrange(4, 256) for _ in range(20)]
    parents, tokens = [-1, -1, 0, 1, 3, 3], [10, 11, 12, 13, 14, 15]
    kv = engine.new_sequence()
    engine.reserve(kv, len(context) - 1)
    engine.forward([Feed(kv, context[:-1], scored=False)])
    engine.reserve(kv, len(tokens) + 1)
    engine.forward([Feed(kv, [context[-1], *tokens], scored=True, parents=feed_parents(parents))])
    path = path_to(parents, 5)  # nodes 1, 3, 5: rows 2, 4, 6 move to consecutive rows
    engine.keep_rows(kv, len(context) - 1, [0, *(n + 1 for n in path)])
    assert kv.length == len(context) + len(path)
    engine.reserve(kv, 1)
    (scores,) = engine.forward([Feed(kv, [77], scored=True)])
    torch.testing.assert_close(scores.logits[0], chain_logits(engine, context, [tokens[n] for n in path] + [77]),
                               atol=1e-4, rtol=1e-4)


def test_greedy_tree_rounds_commit_the_targets_own_tokens(target):
    """A tree holding the target's greedy continuation on a non-first branch is accepted along it, and
    the session then continues from exactly those tokens."""
    verifier = Verifier(target, LIMITS)
    prompt = tuple(range(10, 30))
    opened = verifier.open_session(SessionSpec("t", prompt))
    truth = list(prompt)
    engine = engine_for(target.model, 2048)
    for _ in range(4):
        truth.append(int(chain_logits(engine, truth[:-1], [truth[-1]]).argmax()))
    greedy = truth[len(prompt):]
    wrong = [(t + 1) % 252 + 4 for t in greedy]
    parents = (-1, -1, 1, 1, 3, 2)  # the right path is nodes 1, 3, 4; siblings hold wrong tokens
    tokens = (wrong[0], greedy[0], wrong[1], greedy[1], greedy[2], wrong[2])
    result = verifier.verify(DraftBlock("t", 0, opened.committed_len, tokens, parents=parents))
    assert result.accepted_path == (1, 3, 4)
    assert result.num_accepted == 3 and result.next_token == greedy[3]
    assert result.committed_len == len(prompt) + 4
    chain = verifier.verify(DraftBlock("t", 1, result.committed_len, ()))
    assert chain.next_token == int(chain_logits(engine, truth, []).argmax())


@pytest.mark.parametrize("block, mode, why", [
    (DraftBlock("v", 0, 20, (5, 6), parents=(-1, 1)), Mode.GREEDY, "parent"),
    (DraftBlock("v", 0, 20, (5, 5), parents=(-1, -1)), Mode.GREEDY, "sibling"),
    (DraftBlock("v", 0, 20, (5, 6, 7), parents=(-1, -1)), Mode.GREEDY, "must match"),
    (DraftBlock("v", 0, 20, tuple(range(4, 21)), parents=(-1,) * 17), Mode.GREEDY, "at most 16"),
    (DraftBlock("v", 0, 20, tuple(range(4, 13)), parents=tuple(range(-1, 8))), Mode.GREEDY, "deeper than 8"),
    (DraftBlock("v", 0, 20, (5, 6), parents=(-1, -1)), Mode.BILD, "chains only"),
    (DraftBlock("v", 0, 20, (5, 6), parents=(-1, -1), support_ids=((5, 6), (6, 5)), probs=((0.5, 0.5),) * 2),
     Mode.SPECULATIVE, "siblings"),
])
def test_a_malformed_tree_is_refused_and_changes_nothing(target, block, mode, why):
    verifier = Verifier(target, LIMITS)
    sampling = SamplingParams(temperature=0.0 if mode in (Mode.GREEDY, Mode.BILD) else 1.0)
    verifier.open_session(SessionSpec("v", tuple(range(10, 30)), sampling=sampling, mode=mode))
    (error,) = verifier.verify_batch([block])
    assert isinstance(error, InvalidArgument) and why in str(error)
    after = verifier.verify(DraftBlock("v", 0, 20, ()))  # round 0 is still the next round
    assert after.committed_len == 21


def test_a_server_without_tree_support_says_so_and_refuses_trees(target):
    verifier = Verifier(target, VerifierLimits(max_tree_nodes=0))
    assert verifier.info.max_tree_nodes == 0
    verifier.open_session(SessionSpec("c", tuple(range(10, 30))))
    (error,) = verifier.verify_batch([DraftBlock("c", 0, 20, (5, 6), parents=(-1, -1))])
    assert isinstance(error, InvalidArgument) and "chains only" in str(error)
    chain_as_tree = verifier.verify(DraftBlock("c", 0, 20, (5, 6), parents=(-1, 0)))
    assert chain_as_tree.accepted_path == ()


def test_trees_and_chains_of_other_sessions_share_a_pass_unchanged(target):
    alone = Verifier(target, LIMITS)
    together = Verifier(target, LIMITS)
    for v in (alone, together):
        v.open_session(SessionSpec("a", tuple(range(10, 40))))
        v.open_session(SessionSpec("b", tuple(range(50, 60))))
    chain = DraftBlock("a", 0, 30, (40, 41, 42))
    tree = DraftBlock("b", 0, 10, (60, 61, 62, 63), parents=(-1, -1, 0, 1))
    expected = [alone.verify(chain), alone.verify(tree)]
    got = together.verify_batch([chain, tree])
    for e, g in zip(expected, got):
        assert (e.num_accepted, e.next_token, e.accepted_path) == (g.num_accepted, g.next_token, g.accepted_path)
    assert got[0].batch_size == 2


@pytest.mark.parametrize("limit", [{"max_tree_leaves": 4}, {"max_trees": 2}])
def test_trees_beyond_an_engines_limits_wait_for_the_next_pass(target, limit):
    """An engine that takes only so many tree leaves or trees per pass (llama.cpp: 256 and 8) gets the
    rest in a later pass; every round is answered as it would be alone, and a tree never exceeds the
    leaf limit by itself."""
    engine = engine_for(target.model, 4096)
    engine.capabilities = replace(engine.capabilities, **limit)
    limited = Verifier(target, LIMITS, engine=engine)
    assert limited.info.max_tree_nodes == limit.get("max_tree_leaves", LIMITS.max_tree_nodes)
    alone = Verifier(target, LIMITS)
    blocks = [DraftBlock(f"s{i}", 0, 20, (40 + i, 50 + i, 60 + i), parents=(-1, -1, 0)) for i in range(4)]
    for v in (limited, alone):
        for i in range(4):
            v.open_session(SessionSpec(f"s{i}", tuple(range(10 + i, 30 + i))))
    got = limited.verify_batch(blocks)
    expected = [alone.verify(b) for b in blocks]
    assert [(g.accepted_path, g.next_token) for g in got] == [(e.accepted_path, e.next_token) for e in expected]
    assert [g.batch_size for g in got] == [2, 2, 2, 2]  # two trees (of two leaves) per pass


def test_a_tree_round_returns_the_features_of_the_accepted_path(target):
    """An EAGLE edge drafts chains, but a session that asked for features and sends a tree gets the
    features of the context it now holds: the root and the accepted path, as a chain would give them."""
    tree_side, chain_side = Verifier(target, LIMITS), Verifier(target, LIMITS)
    prompt = tuple(range(10, 30))
    for v in (tree_side, chain_side):
        v.open_session(SessionSpec("f", prompt, features=FeatureFormat.FP16))
    engine = engine_for(target.model, 2048)
    first = int(chain_logits(engine, list(prompt), []).argmax())
    wrong = (first + 1) % 252 + 4
    tree = tree_side.verify(DraftBlock("f", 0, 20, (wrong, first), parents=(-1, -1)))
    assert tree.accepted_path == (1,)
    chain = chain_side.verify(DraftBlock("f", 0, 20, (first,)))
    assert (tree.num_accepted, tree.next_token) == (chain.num_accepted, chain.next_token)
    assert tree.features.start == chain.features.start and tree.features.count == chain.features.count == 2
    torch.testing.assert_close(decode_features(tree.features), decode_features(chain.features), atol=2e-3, rtol=2e-3)
