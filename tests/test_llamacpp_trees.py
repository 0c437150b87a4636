"""Draft trees on the llama.cpp engine, on the embedded target's shipped GGUF: one pass scores every
node exactly as its root path scored as a chain, keep_rows leaves the session as if that path had been
fed as a chain, trees and chains share a pass without disturbing each other, a failed pass changes
nothing, and the cache accounting holds throughout.

Tolerance: none. Measured on the shipped Q4_1 weights, a node's logits equal its root path's as a
chain bit for bit (largest difference 0.0 over every tree here), because the tree context visits a
node's context and ancestors in the order a chain's are visited, with the kernels chains use
(cloud/engine/llamacpp_engine.py)."""
import random

import pytest
import torch

from conftest import LLAMA_CAPACITY, random_ids, require_embedded
from hybridspec.cloud.engine.base import Feed
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.protocol.errors import ResourceExhausted
from hybridspec.common.protocol.tree import feed_parents, path_to

pytestmark = pytest.mark.embedded

def random_tree(rng: random.Random, nodes: int, depth: int = 4) -> tuple[list[int], list[int]]:
    """(parents, tokens) of a draft tree (common/protocol/tree.py) at most `depth` deep, siblings distinct."""
    parents, tokens, level = [], [], []
    for i in range(nodes):
        p = rng.choice([-1] + [j for j in range(i) if level[j] < depth])
        taken = {tokens[j] for j in range(i) if parents[j] == p}
        tokens.append(rng.choice([t for t in range(100, 40000, 97) if t not in taken]))
        parents.append(p)
        level.append(1 if p == -1 else level[p] + 1)
    return parents, tokens


def open_seq(llama_engine, tokens):
    kv = llama_engine.new_sequence()
    llama_engine.reserve(kv, len(tokens))
    for start in range(0, len(tokens), 256):
        llama_engine.forward([Feed(kv, tokens[start:start + 256], scored=False)])
    return kv


def feed_tree(llama_engine, kv, root, parents, tokens, **kw):
    llama_engine.reserve(kv, len(tokens) + 1)
    return llama_engine.forward([Feed(kv, [root, *tokens], scored=True, parents=feed_parents(parents), **kw)])[0]


def chain_scores(llama_engine, context, path):
    """The scores of `path` fed as one chain after `context` (prefilled as the tree's session was), fresh."""
    kv = open_seq(llama_engine, context)
    llama_engine.reserve(kv, len(path))
    scores = llama_engine.forward([Feed(kv, path, scored=True)])[0]
    llama_engine.release(kv)
    return scores


@pytest.mark.slow
@pytest.mark.parametrize("seed,context", [(0, 40), (1, 300), (2, 7), (3, 130)])
def test_a_tree_pass_scores_every_node_as_its_root_path_as_a_chain(llama_engine, seed, context):
    rng = random.Random(seed)
    parents, tokens = random_tree(rng, rng.randint(5, 16))
    prompt = random_ids(seed, context)
    kv = open_seq(llama_engine, prompt[:-1])
    features = seed == 0
    tree = feed_tree(llama_engine, kv, prompt[-1], parents, tokens, features=features)
    assert tree.logits.shape == (len(tokens) + 1, llama_engine.vocab_size) and kv.length == context + len(tokens)
    reference = open_seq(llama_engine, prompt[:-1])  # every root path after the same context, cut back after each
    for row in range(len(tokens) + 1):
        path = [prompt[-1]] + ([] if row == 0 else [tokens[n] for n in path_to(parents, row - 1)])
        llama_engine.reserve(reference, len(path))
        chain = llama_engine.forward([Feed(reference, path, scored=True, features=features)])[0]
        llama_engine.truncate(reference, context - 1)
        assert torch.equal(tree.logits[row], chain.logits[-1]), f"node row {row} of {parents}"
        if features:
            assert torch.equal(tree.hidden[row], chain.hidden[-1])
    llama_engine.release(reference)
    llama_engine.release(kv)


def test_after_keep_rows_the_session_continues_as_if_the_path_were_a_chain(llama_engine):
    prompt = random_ids(20, 90)
    kv = open_seq(llama_engine, prompt[:-1])
    cached, root = prompt[:-1], prompt[-1]
    for parents, tokens, leaf in (([-1, -1, 0, 1, 3, 3, 1], random_ids(21, 7), 5),  # rows 0, 2, 4, 6: not consecutive
                                  ([-1, 0, -1, 2, 2], random_ids(22, 5), 4)):  # then a second round from there
        feed_tree(llama_engine, kv, root, parents, tokens)
        path = path_to(parents, leaf)
        llama_engine.keep_rows(kv, len(cached), [0, *(n + 1 for n in path)])
        cached = cached + [root] + [tokens[n] for n in path]
        assert kv.length == len(cached) and kv.tree is None
        root = 777  # the round's new token heads the next block
    block = [root, *random_ids(23, 2)]
    llama_engine.reserve(kv, len(block))
    after = llama_engine.forward([Feed(kv, block, scored=True)])[0]
    # The chain-fed session: the same prompt, then the kept tokens and the block as one chain.
    chain = chain_scores(llama_engine, prompt[:-1], cached[len(prompt) - 1:] + block)
    assert torch.equal(after.logits, chain.logits[-len(block):])
    llama_engine.release(kv)


def test_a_tree_and_a_chain_in_one_pass_do_not_disturb_each_other(llama_engine):
    a, b = open_seq(llama_engine, random_ids(30, 200)), open_seq(llama_engine, random_ids(31, 57))
    parents, tokens = [-1, -1, -1, 0, 0, 2], random_ids(32, 6)
    block = random_ids(33, 5)
    llama_engine.reserve(b, len(block))
    chain_alone = llama_engine.forward([Feed(b, block, scored=True)])[0]
    llama_engine.truncate(b, 57)
    tree_alone = feed_tree(llama_engine, a, 7, parents, tokens)
    llama_engine.truncate(a, 200)
    llama_engine.reserve(a, len(tokens) + 1)
    llama_engine.reserve(b, len(block))
    both = llama_engine.forward([Feed(b, block, scored=True),
                           Feed(a, [7, *tokens], scored=True, parents=feed_parents(parents))])
    assert torch.equal(both[0].logits, chain_alone.logits)  # bit for bit, as if alone
    assert torch.equal(both[1].logits, tree_alone.logits)
    assert (a.length, b.length) == (207, 62) and a.tree is not None and b.tree is None
    llama_engine.keep_rows(a, 200, [0, 1, 4])
    llama_engine.release(a)
    llama_engine.release(b)


def test_a_failed_pass_changes_no_cache_and_leaves_no_tree(llama_engine):
    good, tree_kv = open_seq(llama_engine, random_ids(40, 30)), open_seq(llama_engine, random_ids(41, 30))
    parents, tokens = [-1, -1, 0], random_ids(42, 3)
    expected = feed_tree(llama_engine, tree_kv, 9, parents, tokens).logits
    llama_engine.truncate(tree_kv, 30)
    for bad_tree in (False, True):  # a bad token in the chain (decoded first), then in the tree (after it)
        llama_engine.reserve(good, 2)
        llama_engine.reserve(tree_kv, 4)
        tree_tokens = [9, *tokens[:-1], llama_engine.vocab_size + 5] if bad_tree else [9, *tokens]
        with pytest.raises(RuntimeError, match="llama_decode failed"):
            llama_engine.forward([Feed(good, [21, 22] if bad_tree else [llama_engine.vocab_size + 5, 22], scored=True),
                            Feed(tree_kv, tree_tokens, scored=True, parents=feed_parents(parents))])
        assert (good.length, tree_kv.length) == (30, 30) and tree_kv.tree is None
    assert torch.equal(feed_tree(llama_engine, tree_kv, 9, parents, tokens).logits, expected)
    with pytest.raises(ValueError, match="root path"):
        llama_engine.keep_rows(tree_kv, 30, [0, 2, 3])  # node 2 is not below node 1
    with pytest.raises(ValueError, match="before feeding it again"):
        llama_engine.forward([Feed(tree_kv, [5], scored=True)])
    assert tree_kv.length == 34 and tree_kv.tree is not None  # refusals change nothing
    llama_engine.truncate(tree_kv, 30)  # a failed round: the tree goes
    assert tree_kv.length == 30 and tree_kv.tree is None
    llama_engine.release(good)
    llama_engine.release(tree_kv)


def test_the_cache_accounting_holds_across_trees(llama_engine):
    fill = llama_engine.fill()
    kv = open_seq(llama_engine, random_ids(50, 100))
    assert llama_engine.fill() == fill + 100 / LLAMA_CAPACITY
    parents, tokens = [-1, -1, 1, 1, 2], random_ids(51, 5)
    feed_tree(llama_engine, kv, 3, parents, tokens)
    assert (kv.length, kv.held) == (106, 106) and llama_engine.fill() == fill + 106 / LLAMA_CAPACITY
    llama_engine.keep_rows(kv, 100, [0, 2, 3])
    assert (kv.length, kv.held) == (103, 103) and llama_engine.fill() == fill + 103 / LLAMA_CAPACITY
    share = llama_engine.capabilities.max_sequence_tokens
    assert llama_engine.fits(kv, share - 103) and not llama_engine.fits(kv, share - 102)
    with pytest.raises(ResourceExhausted):
        llama_engine.reserve(kv, share - 102)
    feed_tree(llama_engine, kv, 4, parents, tokens)
    llama_engine.truncate(kv, 103)  # a failed round drops the tree
    assert (kv.length, kv.held) == (103, 103) and llama_engine.fill() == fill + 103 / LLAMA_CAPACITY
    feed_tree(llama_engine, kv, 4, parents, tokens)
    llama_engine.release(kv)  # with its tree pending
    assert llama_engine.fill() == fill and llama_engine.fits(llama_engine.new_sequence(), share)


def test_a_chain_shaped_tree_is_a_chain(llama_engine):
    kv = open_seq(llama_engine, random_ids(60, 50))
    block = random_ids(61, 4)
    llama_engine.reserve(kv, 4)
    as_tree = llama_engine.forward([Feed(kv, block, scored=True, parents=(-1, 0, 1, 2))])[0]
    assert kv.tree is None
    llama_engine.keep_rows(kv, 50, [0, 1])  # on a chain: truncate
    assert kv.length == 52
    llama_engine.truncate(kv, 50)
    llama_engine.reserve(kv, 4)
    assert torch.equal(llama_engine.forward([Feed(kv, block, scored=True)])[0].logits, as_tree.logits)
    llama_engine.release(kv)


def test_greedy_tree_rounds_through_the_verifier_commit_the_engines_own_tokens():
    """A tree holding the engine's own greedy continuation on a non-first branch is accepted along it,
    and the session then goes on exactly as the engine's one-token-per-round decoding does."""
    require_embedded()
    from hybridspec.cloud.core.verifier import Verifier
    from hybridspec.cloud.engine.factory import load_engine
    from hybridspec.cloud.core.limits import VerifierLimits
    from hybridspec.cloud.engine.kinds import EngineKind
    from hybridspec.common.config import DType
    from hybridspec.common.protocol.wire import DraftBlock, SessionSpec

    limits = VerifierLimits(max_sessions=4, kv_cache_tokens=4096, max_tree_nodes=16)
    target, served = load_engine(str(default_paths()["target"]), EngineKind.LLAMACPP, "cpu", DType.AUTO, 1, limits)
    verifier = Verifier(target, limits, served)
    assert verifier.info.max_tree_nodes == 16
    prompt = tuple(random_ids(70, 40))
    length, greedy = verifier.open_session(SessionSpec("alone", prompt)).committed_len, []
    for r in range(5):  # the reference: empty drafts, one token a round
        result = verifier.verify(DraftBlock("alone", r, length, ()))
        greedy.append(result.next_token)
        length = result.committed_len
    wrong = [t + 1 for t in greedy]
    opened = verifier.open_session(SessionSpec("tree", prompt))
    parents = (-1, -1, 1, 1, 3, 2)  # the right path is nodes 1, 3, 4; their siblings hold wrong tokens
    tokens = (wrong[0], greedy[0], wrong[1], greedy[1], greedy[2], wrong[2])
    result = verifier.verify(DraftBlock("tree", 0, opened.committed_len, tokens, parents=parents))
    assert result.accepted_path == (1, 3, 4) and result.next_token == greedy[3]
    assert verifier.verify(DraftBlock("tree", 1, result.committed_len, ())).next_token == greedy[4]


def _resident_mb() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) // 1024


@pytest.mark.slow
def test_the_tree_context_is_ready_before_the_first_tree_and_bounds_trees_per_pass():
    """Made at the first tree, the tree context (1.5 GB cleared at the default 65,536 cells) stalled that
    pass, and every session's round in it, for seconds. It is made with the engine, of TREE_STREAMS
    streams, and a pass with more trees than that is refused (the verifier defers them)."""
    require_embedded()
    from hybridspec.cloud.engine.llamacpp_engine import TREE_STREAMS, LlamaCppEngine
    from hybridspec.common.models.gguf import find_gguf

    engine = LlamaCppEngine(find_gguf(default_paths()["target"]), 32 * 1024, max_sequences=32, threads=1)
    assert engine.capabilities.max_trees == TREE_STREAMS
    kvs = [open_seq(engine, random_ids(i, 20)) for i in range(TREE_STREAMS + 1)]
    before = _resident_mb()
    feed_tree(engine, kvs[0], 7, [-1, -1, 0], [100, 101, 102])
    assert _resident_mb() - before < 64  # 188 MB of cells (8,192 of 1,024-token streams) were made here
    engine.truncate(kvs[0], 20)
    for kv in kvs:
        engine.reserve(kv, 3)
    with pytest.raises(ResourceExhausted, match="draft trees a pass"):
        engine.forward([Feed(kv, [7, 100, 101], scored=True, parents=(-1, 0, 0)) for kv in kvs])
    assert all(kv.tree is None for kv in kvs)
    assert len(engine.forward([Feed(kv, [7, 100, 101], scored=True, parents=(-1, 0, 0)) for kv in kvs[:-1]])) == 8
