"""Sampling modes over real gRPC: seeded reproducibility and each rule end to end."""
import pytest

from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.worker import EdgeWorker

from tinymodels import EVERY_ROUND

PROMPT = [5, 17, 33, 80]


def generate(server, drafter, **cfg):
    # A fixed seed: a run that hit an end-of-sequence token early would fail the length checks by chance.
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=20, max_draft=4, **{"seed": 0, **EVERY_ROUND, **cfg})
    with VerifierClient(server.address) as client:
        return EdgeWorker(drafter, client, config).generate(PROMPT)


def test_seed_makes_a_sampled_run_reproducible(server, random_drafter):
    a = generate(server, random_drafter, temperature=1.0, seed=3)
    b = generate(server, random_drafter, temperature=1.0, seed=3)
    c = generate(server, random_drafter, temperature=1.0, seed=4)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_drafter_equal_to_target_is_always_accepted_when_sampling(server, target):
    gen = generate(server, target, temperature=0.8, top_k=50, top_p=0.95, wire_top_k=0, fallback_threshold=0.0)
    # q = p exactly (same model, same transform, full support): min(1, p/q) = 1 everywhere.
    assert gen.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("cfg", [dict(mode="bild", rollback_threshold=2.0),
                                 dict(mode="bild", temperature=0.7, rollback_threshold=2.0),
                                 dict(mode="lenient", temperature=1.0, lenience=0.5),
                                 dict(mode="speculative", temperature=1.0, top_k=20, wire_top_k=8)])
def test_every_mode_runs_end_to_end(server, random_drafter, cfg):
    gen = generate(server, random_drafter, **cfg)
    assert len(gen.token_ids) == 20
    assert all(0 <= t < 256 for t in gen.token_ids)
    assert gen.stats.uplink_bytes > 0 and gen.stats.downlink_bytes > 0


def test_bild_accepts_more_than_greedy(server, random_drafter):
    greedy = generate(server, random_drafter, fallback_threshold=0.0)
    lossy = generate(server, random_drafter, mode="bild", rollback_threshold=50.0, fallback_threshold=0.0)
    assert lossy.stats.acceptance_rate > greedy.stats.acceptance_rate
