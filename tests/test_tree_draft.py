"""Draft trees: the LMs score tree nodes as their root paths fed as chains (torch: a 4-D mask; llama.cpp:
a sequence per branch) and come back to the context afterwards; `draft_tree` keeps its budget, grows a
well-formed tree, is the chain at top_k = 1, stops where a chain stops, and sends exact q (siblings
drawn without replacement from their parent's truncated q). Tiny random models, plus the real drafter."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import require_embedded
from hybridspec.common.maths.sampling import gumbel_max, logits_to_probs, penalize
from hybridspec.common.maths.sparse import truncate
from hybridspec.common.models.compact import Manifest
from hybridspec.common.models.loading import load_model
from hybridspec.common.protocol.tree import ROOT, check_tree, children, chain_parents, depths, path_to
from hybridspec.common.protocol.wire import SamplingParams
from hybridspec.edge.draft_lm import TorchLM
from hybridspec.edge.drafter import ModelDrafter
from hybridspec.edge.proposal import DraftSettings, Drafting, DrafterKind
from hybridspec.edge.tree_draft import TreeBudget, draft_tree

llama_lm = pytest.importorskip("hybridspec.edge.llamacpp_lm")

VOCAB = 256
# A tree node against its root path fed as a chain, largest |logit difference| (logits span about ±5;
# a sibling left visible moves them by 2.7 to 5): torch sums the same terms under a mask, a few float32
# ulps apart (7e-6 seen); llama.cpp Q8_0 computes a row alone or in a block bit for bit (0 seen).
TREE_TOLERANCE = {"torch": 1e-4, "llamacpp": 1e-3}
# A tree whose node 3 and 4 are siblings of node 1 and 2 (fed in two calls, the second hanging nodes
# from the first's), with a node of depth 3.
TOKENS = [50, 51, 52, 60, 61, 62, 70]
PARENTS = [-1, -1, -1, 0, 0, 1, 3]


def contexts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, VOCAB, length).tolist() for _ in range(n)]


def settings(temperature: float = 0.0, penalty: float = 1.0, **kw) -> DraftSettings:
    """No fallback and no stop ids unless asked for."""
    drafting = {"fallback_threshold": 0.0, **{k: kw.pop(k) for k in list(kw) if hasattr(Drafting, k)}}
    kw.setdefault("stop_ids", frozenset())
    return DraftSettings(sampling=SamplingParams(temperature=temperature, repetition_penalty=penalty),
                         vocab_size=VOCAB, drafting=Drafting(**drafting), **kw)


@pytest.fixture(scope="module")
def llama_path(model_dirs, target, tmp_path_factory):
    """A 2-layer compact drafter of the tiny target over a 160-row head, converted to Q8_0."""
    from hybridspec.common.models.drafter_gguf import convert_drafter
    from hybridspec.distill.student import build_student, own_state, save_compact

    head_ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:160]
    student = build_student(target.model, 2, head_ids)
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in student.model.layers.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=noise, dtype=p.dtype))
    out = tmp_path_factory.mktemp("tree-compact") / "drafter"
    save_compact(own_state(student), head_ids, out, Manifest(base=str(model_dirs["target"]), num_layers=2,
                                                             base_tokenizer_fingerprint=""))
    convert_drafter(out, "Q8_0", log=lambda _: None)
    return out


@pytest.fixture(params=["torch", "llamacpp"])
def new_lm(request, target, llama_path):
    """(engine name, a function making a fresh LM of one drafter on that engine)."""
    if request.param == "torch":
        return "torch", lambda: TorchLM(target, VOCAB)
    loaded = load_model(llama_path, device="cpu", engine="llamacpp")
    return "llamacpp", lambda: llama_lm.LlamaCppLM.open(loaded.llama, loaded.head_ids, VOCAB)


def close(a: torch.Tensor, b: torch.Tensor, engine: str) -> bool:
    """Equal argmax, the same ids outside the head, and logits within the engine's tolerance."""
    finite = torch.isfinite(b)
    return bool(a.argmax() == b.argmax() and torch.equal(torch.isfinite(a), finite)
                and (a[finite] - b[finite]).abs().max() < TREE_TOLERANCE[engine])


def test_tree_nodes_score_as_their_root_paths(new_lm):
    """Every node's logits are those after context + its root path: siblings and cousins are hidden,
    whether the tree comes in one call or in two; the next advance equals a fresh LM's."""
    engine, new = new_lm
    context, other = contexts(1, 2, 30)
    lm = new()
    lm.advance(context)
    rows = torch.cat([lm.feed_tree(TOKENS[:3], PARENTS[:3]), lm.feed_tree(TOKENS[3:], PARENTS[3:])])
    for i in range(len(TOKENS)):
        reference = new().advance(context + [TOKENS[j] for j in path_to(PARENTS, i)])
        assert close(rows[i], reference, engine), i
    whole = new()
    whole.advance(context)
    assert all(close(a, b, engine) for a, b in zip(whole.feed_tree(TOKENS, PARENTS), rows))
    # The check can fail: fed as a chain, node 1 would see node 0 and score otherwise.
    chained = new()
    chained.advance(context)
    assert not close(chained.feed_tree(TOKENS[:2], [-1, 0])[1], rows[1], engine)
    # Back to a context sharing a prefix, or one growing this one: as a fresh LM.
    for after in (context[:20] + other[:5], context + [TOKENS[0], 9]):
        assert close(lm.advance(after), new().advance(after), engine)
        assert lm.cached == after
        lm.feed_tree(TOKENS[:3], PARENTS[:3])
    assert close(lm.feed([9]), new().advance(after + [9]), engine)  # feed drops the tree too


def test_a_chain_fed_as_a_tree_is_the_chain_bit_for_bit(new_lm):
    _, new = new_lm
    context = contexts(2, 1, 25)[0]
    tree, chain = new(), new()
    tree.advance(context)
    chain.advance(context)
    assert torch.equal(tree.feed_tree([40], [-1])[0], chain.feed([40]))
    assert torch.equal(tree.feed_tree([41, 42], [0, 1])[1], chain.feed([41, 42]))


def test_bad_parents_are_refused(target):
    lm = TorchLM(target, VOCAB)
    lm.advance(contexts(3, 1, 10)[0])
    for tokens, parents in (([5], [0]), ([5, 6], [-1, 1]), ([5], [-2]), ([5, 6], [-1])):
        with pytest.raises(ValueError):
            lm.feed_tree(tokens, parents)
    assert len(lm.tree) == 0


def test_llamacpp_trees_are_bounded_by_its_sequences(llama_path):
    """A branch per sequence: a tree needing more is refused, and the LM is left with its context."""
    loaded = load_model(llama_path, device="cpu", engine="llamacpp")
    model = llama_lm.LlamaDraftModel.shared(loaded.llama, loaded.head_ids.numpy())
    lm = llama_lm.LlamaCppLM(model, VOCAB, n_ctx=64)  # batches of 64 rows, hence 64 sequences
    context = contexts(13, 1, 20)[0]
    lm.advance(context)
    lm.feed_tree(list(range(4, 68)), [-1] * 64)  # the context's sequence and 63 more
    with pytest.raises(ValueError, match="leaves"):
        lm.feed_tree([100], [-1])
    assert len(lm.tree) == 0 and lm.cached == context
    fresh = llama_lm.LlamaCppLM(model, VOCAB, n_ctx=64)
    assert close(lm.advance(context + [5]), fresh.advance(context + [5]), "llamacpp")


def well_formed(proposal, budget: TreeBudget) -> None:
    """Parents precede children, siblings are distinct, and the budget holds."""
    parents = proposal.parents
    assert parents is not None and len(parents) == len(proposal.ids) <= budget.nodes
    check_tree(parents, proposal.ids, budget.nodes, budget.depth)
    assert all(len(kids) <= budget.top_k for kids in children(parents))


BUDGETS = [TreeBudget(4, 8, 4), TreeBudget(16, 8, 4), TreeBudget(32, 3, 4), TreeBudget(9, 9, 2)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("budget", BUDGETS)
def test_trees_keep_their_budget(random_drafter, temperature, budget):
    drafter = ModelDrafter(random_drafter, settings(temperature, wire_top_k=16))
    for context in contexts(4, 3, 20):
        proposal = draft_tree(drafter, context, budget)
        well_formed(proposal, budget)
        assert len(proposal.ids) == budget.nodes  # nothing stops these trees early
        assert drafter.lm.cached == context


@pytest.mark.parametrize("keep", [True, False])
def test_a_top1_tree_is_the_greedy_chain(random_drafter, keep):
    """Tokens, fallback flag and stops as propose's, at a threshold that stops some chains early."""
    s = settings(fallback_threshold=0.1, keep_low_confidence=keep, stop_ids=frozenset(range(4, 40)))
    tree_drafter, chain_drafter = ModelDrafter(random_drafter, s), ModelDrafter(random_drafter, s)
    lengths = set()
    for context in contexts(5, 8, 20):
        chain = chain_drafter.propose(context, 8)
        tree = draft_tree(tree_drafter, context, TreeBudget(8, 8, 1))
        assert (tree.ids, tree.fell_back, tree.dists, tree.ranked) == (chain.ids, chain.fell_back, None, chain.ranked)
        assert tree.parents == chain_parents(len(chain.ids))
        lengths.add(len(chain.ids))
    assert len(lengths) > 1, "the settings should stop some chains early"


def test_a_top1_sampled_tree_is_the_sampled_chain(random_drafter):
    """Same seed, same generator draws: a sampled chain and its q."""
    s = settings(1.0, wire_top_k=32, seed=5)
    tree_drafter, chain_drafter = ModelDrafter(random_drafter, s), ModelDrafter(random_drafter, s)
    for context in contexts(6, 3, 20):
        chain, tree = chain_drafter.propose(context, 6), draft_tree(tree_drafter, context, TreeBudget(6, 6, 1))
        assert tree.ids == chain.ids
        assert all(torch.equal(a.ids, b.ids) and torch.equal(a.probs, b.probs) for a, b in zip(tree.dists, chain.dists))


def test_low_confidence_and_stop_ids_end_branches(random_drafter):
    context = contexts(7, 1, 20)[0]
    budget = TreeBudget(16, 8, 4)
    # Every q is below α_FB = 1: the root's children are drafted (kept) but none is expanded, or none at all.
    kept = draft_tree(ModelDrafter(random_drafter, settings(fallback_threshold=1.0)), context, budget)
    assert kept.fell_back and kept.parents == (ROOT,) * 4
    dropped = draft_tree(ModelDrafter(random_drafter, settings(fallback_threshold=1.0, keep_low_confidence=False)),
                         context, budget)
    assert dropped.fell_back and dropped.ids == []
    # A stop id ends its branch and no other.
    free = draft_tree(ModelDrafter(random_drafter, settings()), context, budget)
    stop = free.ids[1]
    stopped = draft_tree(ModelDrafter(random_drafter, settings(stop_ids=frozenset({stop}))), context, budget)
    node = stopped.ids.index(stop)
    assert node not in stopped.parents and len(stopped.ids) == 16 and not stopped.fell_back
    # An interrupt stops the growth between depths; one true from the start drafts nothing.
    calls = iter(range(100))
    early = draft_tree(ModelDrafter(random_drafter, settings()), context, budget, interrupt=lambda: next(calls) >= 2)
    assert max(depths(early.parents)) == 2
    assert draft_tree(ModelDrafter(random_drafter, settings()), context, budget, interrupt=lambda: True).ids == []


def test_sampled_trees_send_the_q_each_node_was_drawn_from(random_drafter):
    """Siblings share their parent's dist (the truncated q after the parent's path), and each token is in it."""
    s = settings(0.8, penalty=1.3, wire_top_k=12, seed=3)
    drafter = ModelDrafter(random_drafter, s)
    context = contexts(8, 1, 20)[0]
    proposal = draft_tree(drafter, context, TreeBudget(24, 5, 3))
    well_formed(proposal, TreeBudget(24, 5, 3))
    assert len(proposal.dists) == len(proposal.ids)
    for kids in children(proposal.parents):
        assert all(proposal.dists[k] is proposal.dists[kids[0]] for k in kids)
    fresh = TorchLM(random_drafter, VOCAB)
    for i, (token, dist) in enumerate(zip(proposal.ids, proposal.dists)):
        assert token in dist.ids.tolist() and dist.ids.numel() <= 12
        assert abs(dist.probs.sum().item() - 1) < 1e-5
        history = context + [proposal.ids[j] for j in path_to(proposal.parents, i)[:-1]]
        penalized = penalize(fresh.advance(history)[None], s.sampling, history, len(context))[0]
        expected = truncate(logits_to_probs(penalized, s.sampling), 12)
        assert torch.equal(dist.ids, expected.ids) and torch.allclose(dist.probs, expected.probs, atol=1e-5)


def test_sampled_trees_are_seeded(random_drafter):
    context = contexts(9, 1, 20)[0]
    budget = TreeBudget(16, 6, 4)

    def tree(seed: int):
        return draft_tree(ModelDrafter(random_drafter, settings(1.0, seed=seed)), context, budget)

    a, b, c = tree(1), tree(1), tree(2)
    assert (a.ids, a.parents) == (b.ids, b.parents)
    assert a.ids != c.ids


def test_coupled_trees_put_the_coupled_draw_first(random_drafter):
    s = settings(1.0, coupled=True, seed=11, wire_top_k=16)
    context = contexts(10, 1, 20)[0]
    proposal = draft_tree(ModelDrafter(random_drafter, s), context, TreeBudget(12, 4, 3))
    kids = children(proposal.parents)
    for node, siblings in enumerate(kids):
        if not siblings:
            continue
        dist = proposal.dists[siblings[0]]
        depth = 0 if node == 0 else depths(proposal.parents)[node - 1]
        assert proposal.ids[siblings[0]] == gumbel_max(dist.ids, dist.probs, 11, len(context) + depth)
        q = dict(zip(dist.ids.tolist(), dist.probs.tolist()))
        rest = [q[proposal.ids[k]] for k in siblings[1:]]
        assert rest == sorted(rest, reverse=True)


def test_in_coupled_mode_the_target_is_ranked_against_the_coupled_draw_first(random_drafter):
    """Regression: every node ranked the target's token against the drafter's likeliest tokens, while
    a coupled chain drafts, and a coupled tree puts first, the coupled draw. Sampling at T = 0.7, the
    rank statistic ρ_1 then read 0.97 where the first draft's agreement was 0.75, and a tree looked
    like it would pay (docs/experiments.md, never slower). Now each node's first ranked choice is the
    token a chain or a tree's first child takes there."""
    s = settings(1.5, coupled=True, seed=3, wire_top_k=16)
    context = contexts(12, 1, 20)[0]
    chain = ModelDrafter(random_drafter, s).propose(context, 6, fallback=False)
    assert [r[0] for r in chain.ranked] == chain.ids
    tree = draft_tree(ModelDrafter(random_drafter, s), context, TreeBudget(12, 4, 3))
    for siblings in children(tree.parents):
        for kid in siblings:
            assert tree.ranked[kid][0] == tree.ids[siblings[0]]
    greedy = ModelDrafter(random_drafter, settings(0.0)).propose(context, 6, fallback=False)
    assert [r[0] for r in greedy.ranked] == greedy.ids and all(len(r) == len(set(r)) for r in greedy.ranked)
    # At T = 1.5 the coupled draw is often not the likeliest token: the old ranking differed here.
    likeliest = [torch.topk(d.probs, 1).indices.item() for d in chain.dists]
    assert any(d.ids[i].item() != t for d, i, t in zip(chain.dists, likeliest, chain.ids))


@pytest.mark.slow
def test_siblings_are_draws_without_replacement(random_drafter):
    """Over 3000 trees of the root's two children: the first child is distributed as q, the second as
    q with the first removed (chi-square, 7 degrees of freedom, each below 24.3: p = 0.001)."""
    context = contexts(11, 1, 20)[0]
    drafter = ModelDrafter(random_drafter, settings(1.5, wire_top_k=8, seed=4))
    q = truncate(logits_to_probs(TorchLM(random_drafter, VOCAB).advance(context), drafter.sampling), 8)
    ids, p = q.ids.tolist(), q.probs.double()
    firsts, seconds = Counter(), Counter()
    n = 3000
    for _ in range(n):
        tree = draft_tree(drafter, context, TreeBudget(2, 1, 2))
        firsts[tree.ids[0]] += 1
        seconds[tree.ids[1]] += 1
    second = torch.stack([sum(p[a] * p[b] / (1 - p[a]) for a in range(8) if a != b) for b in range(8)])
    for counts, expected in ((firsts, p), (seconds, second)):
        observed = torch.tensor([counts[t] for t in ids], dtype=torch.float64)
        chi2 = (((observed - n * expected) ** 2) / (n * expected)).sum().item()
        assert chi2 < 24.3, (chi2, observed.tolist(), (n * expected).tolist())


def test_the_cache_is_reused_after_a_tree(random_drafter):
    """After a tree the LM holds the context; the next chain or tree equals a fresh drafter's."""
    context, other = contexts(12, 2, 20)
    drafter = ModelDrafter(random_drafter, settings())
    tree = draft_tree(drafter, context, TreeBudget(16, 6, 4))
    assert drafter.lm.cached == context and len(drafter.lm.tree) > 0
    accepted = context + [tree.ids[0], 7]
    assert drafter.propose(accepted, 6).ids == ModelDrafter(random_drafter, settings()).propose(accepted, 6).ids
    assert drafter.lm.cached[:len(accepted)] == accepted
    again = draft_tree(drafter, context[:10] + other, TreeBudget(16, 6, 4))
    assert again == draft_tree(ModelDrafter(random_drafter, settings()), context[:10] + other, TreeBudget(16, 6, 4))


@pytest.mark.embedded
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", "llamacpp"])
def test_the_shipped_drafter_drafts_trees(engine):
    """The real drafter on a free-form prompt: nodes score as their root paths, the top-1 tree is the
    chain, and a 32-node tree is well formed."""
    require_embedded()
    from hybridspec.common.models.embedded import default_paths
    from hybridspec.distill.prompts import FREEFORM_PROMPTS
    from hybridspec.edge.drafters import make_drafter
    from hybridspec.edge.prompt import encode_prompt

    loaded = load_model(default_paths()["plain"], device="cpu", engine=engine)
    vocab = loaded.vocab_size
    s = replace(settings(), vocab_size=vocab)
    prompt = encode_prompt(loaded.tokenizer, FREEFORM_PROMPTS[0], chat=True)
    drafter = make_drafter(DrafterKind.MODEL, loaded, s)
    budget = TreeBudget(32, 8, 4)
    tree = draft_tree(drafter, prompt, budget)
    well_formed(tree, budget)
    # All 32 nodes, and deeper than the whole budget spent level by level would go (4 + 16 + 12 nodes).
    assert len(tree.ids) == 32 and max(depths(tree.parents)) > 3
    fresh = make_drafter(DrafterKind.MODEL, loaded, s)
    assert draft_tree(drafter, prompt, TreeBudget(8, 8, 1)).ids == fresh.propose(prompt, 8).ids
    lm = drafter.lm
    lm.advance(prompt)
    rows = lm.feed_tree(tree.ids, list(tree.parents))
    for i in range(0, 32, 3):
        path = [tree.ids[j] for j in path_to(tree.parents, i)]
        assert close(rows[i], make_drafter(DrafterKind.MODEL, loaded, s).lm.advance(prompt + path), engine), i
