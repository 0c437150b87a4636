"""Draft trees end to end, edge → gRPC → verifier: the committed text is exactly the target's (greedy),
the target's own for a seed (coupled), and sampled runs reproduce; rounds really carry trees."""
import pytest
import torch

from hybridspec.common.models.loading import load_model
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.generation import Origin
from hybridspec.edge.worker import EdgeWorker

from tinymodels import EVERY_ROUND, greedy_reference, make_model, save_model

PROMPTS = [[7], [5, 17, 33, 80], [9, 200, 31, 31, 64, 12, 100, 8, 41, 77, 5, 190, 6]]
NEW_TOKENS = 24
TREES = dict(EVERY_ROUND, gamma_policy="tree")


def run(server, drafter, prompts=PROMPTS, **cfg):
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW_TOKENS, **{**TREES, **cfg})
    with VerifierClient(server.address) as client:
        worker = EdgeWorker(drafter, client, config)
        return [worker.generate(p) for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("nodes, top_k, depth", [(4, 2, 3), (8, 4, 4), (16, 4, 8)])
@pytest.mark.parametrize("pipeline", [False, True], ids=["sequential", "pipelined"])
def test_greedy_trees_give_the_targets_text(server, target, random_drafter, nodes, top_k, depth, pipeline):
    for drafter in (target, random_drafter):
        gens = run(server, drafter, tree_nodes=nodes, tree_top_k=top_k, max_draft=depth, fallback_threshold=0.0,
                   pipeline=pipeline)
        for prompt, gen in zip(PROMPTS, gens):
            assert gen.token_ids == greedy_reference(target, prompt, NEW_TOKENS)
            assert gen.stats.tree_rounds > 0 and gen.stats.drafted <= nodes * gen.stats.rounds
    agreeing = run(server, target, tree_nodes=nodes, tree_top_k=top_k, max_draft=depth, fallback_threshold=0.0)
    assert all(Origin.CORRECTED not in gen.origins for gen in agreeing)


@pytest.fixture(scope="module")
def noisy_target(tmp_path_factory):
    """The target with a perturbed output head: its first choice is often wrong, the target's token
    usually among its next few."""
    model = make_model(seed=0)
    torch.manual_seed(3)
    with torch.no_grad():
        model.lm_head.weight.add_(0.15 * torch.randn_like(model.lm_head.weight))
    return load_model(save_model(model, tmp_path_factory.mktemp("noisy")), device="cpu")


def test_a_tree_is_accepted_off_its_main_path(server, target, noisy_target):
    """Second choices get accepted: a tree commits more per round than the chain at the same depth."""
    chain = run(server, noisy_target, gamma_policy="fixed", max_draft=3, fallback_threshold=0.0)
    tree = run(server, noisy_target, tree_nodes=16, tree_top_k=4, max_draft=3, fallback_threshold=0.0)
    assert sum(g.stats.accepted for g in chain) < 0.9 * sum(g.stats.rounds * 3 for g in chain)
    assert sum(g.stats.accepted / g.stats.rounds for g in tree) > sum(g.stats.accepted / g.stats.rounds for g in chain)
    for prompt, gen in zip(PROMPTS, tree):
        assert gen.token_ids == greedy_reference(target, prompt, NEW_TOKENS)


def test_coupled_trees_give_the_seeds_own_text(server, target, random_drafter):
    """Coupled sampling is drafter-invariant: a tree round commits the target's own draw for the seed,
    so trees, chains and either drafter give one text."""
    texts = set()
    for drafter in (target, random_drafter):
        for cfg in (dict(gamma_policy="tree", tree_nodes=8), dict(gamma_policy="fixed", tree_nodes=0)):
            (gen,) = run(server, drafter, prompts=[PROMPTS[1]], temperature=1.0, seed=11, mode="coupled",
                         max_draft=4, fallback_threshold=0.0, **cfg)
            texts.add(tuple(gen.token_ids))
    assert len(texts) == 1


def test_speculative_trees_reproduce_for_a_seed_and_accept_an_agreeing_drafter(server, target):
    cfg = dict(temperature=1.0, seed=5, mode="speculative", tree_nodes=8, max_draft=4, fallback_threshold=0.0,
               wire_top_k=0, pipeline=False)  # q is then exactly p; drafting ahead draws as time allows
    first = run(server, target, prompts=[PROMPTS[1]], **cfg)[0]
    again = run(server, target, prompts=[PROMPTS[1]], **cfg)[0]
    assert first.token_ids == again.token_ids and first.stats.tree_rounds > 0
    # The drafter is the target: its first child is always accepted, so no round ends in a correction.
    assert Origin.CORRECTED not in first.origins


def test_adaptive_edges_stay_lossless_with_trees_on(server, target, random_drafter):
    for drafter in (target, random_drafter):
        gens = run(server, drafter, gamma_policy="adaptive", tree_nodes=16, max_draft=8)
        for prompt, gen in zip(PROMPTS, gens):
            assert gen.token_ids == greedy_reference(target, prompt, NEW_TOKENS)
