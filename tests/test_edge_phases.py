"""A generation builds its drafter, its hybrid session and its verify round once (edge/context.py
`build_drafting`), whichever phase it starts in, and its output stays the target's."""
from __future__ import annotations

import pytest

from hybridspec.edge import drafters
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.session import CloudSession
from hybridspec.edge.worker import EdgeWorker

from hybridspec.lab.tinymodels import EVERY_ROUND, greedy_reference

PROMPT = [5, 17, 33, 80]
NEW = 24


@pytest.mark.parametrize("settings", [EVERY_ROUND, dict(probe_tokens=4)], ids=["hybrid", "warming-up-cloud-only"])
def test_the_drafter_and_the_hybrid_session_are_built_once(server, target, monkeypatch, settings):
    """Found reading the tree (issue 41): a generation built its hybrid session when it started and
    again when its drafter was first read (a lazy property), so two sessions existed for one
    generation. A cloud-only stream's own session (measure_opens=False) is not the hybrid one."""
    built: list[str] = []
    make_drafter, session_init = drafters.make_drafter, CloudSession.__init__

    def counting_make_drafter(*args, **kwargs):
        built.append("drafter")
        return make_drafter(*args, **kwargs)

    def counting_session_init(self, *args, measure_opens: bool = True, **kwargs):
        if measure_opens:
            built.append("session")
        session_init(self, *args, measure_opens=measure_opens, **kwargs)

    monkeypatch.setattr(drafters, "make_drafter", counting_make_drafter)
    monkeypatch.setattr(CloudSession, "__init__", counting_session_init)
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW, max_draft=4, fallback_threshold=0.0, **settings)
    with VerifierClient(server.address, timeout_s=config.link.timeout_s) as client:
        run = EdgeWorker(target, client, config).stream(PROMPT)
        list(run)
    gen = run.generation
    assert gen.token_ids == greedy_reference(target, PROMPT, NEW)
    assert sorted(built) == ["drafter", "session"], built
    assert run.drafting is not None and (gen.stats.rounds > 0 or gen.stats.cloud_only_tokens == NEW)
