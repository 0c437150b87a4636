"""A generation builds its drafter once (edge/generation.py `Generation._build_drafter`), whichever
phase it starts in, opens one session per stretch of a phase, and its output stays the target's."""
from __future__ import annotations

import pytest

from hybridspec.edge import drafters
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.worker import EdgeWorker

from tinymodels import EVERY_ROUND, greedy_reference

PROMPT = [5, 17, 33, 80]
NEW = 24


@pytest.mark.parametrize("settings", [EVERY_ROUND, dict(probe_tokens=4)], ids=["hybrid", "warming-up-cloud-only"])
def test_the_drafter_is_built_once_and_each_stretch_opens_one_session(server, target, monkeypatch, settings):
    """Found reading the tree (issue 41): a generation built its hybrid session when it started and
    again when its drafter was first read (a lazy property), so two sessions existed for one
    generation. A generation now has one session id; each stretch of hybrid rounds or cloud-only
    decoding opens it once."""
    built: list[str] = []
    opens: list[int] = []
    make_drafter, begin_open = drafters.make_drafter, VerifierClient.begin_open

    def counting_make_drafter(*args, **kwargs):
        built.append("drafter")
        return make_drafter(*args, **kwargs)

    def counting_begin_open(self, spec):
        opens.append(len(spec.committed_ids))
        return begin_open(self, spec)

    monkeypatch.setattr(drafters, "make_drafter", counting_make_drafter)
    monkeypatch.setattr(VerifierClient, "begin_open", counting_begin_open)
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW, max_draft=4, fallback_threshold=0.0, **settings)
    with VerifierClient(server.address, timeout_s=config.link.timeout_s) as client:
        gen = EdgeWorker(target, client, config).stream(PROMPT)
        list(gen)
    assert gen.token_ids == greedy_reference(target, PROMPT, NEW)
    assert built == ["drafter"], built
    assert gen.drafter is not None and (gen.stats.rounds > 0 or gen.stats.cloud_only_tokens == NEW)
    if settings is EVERY_ROUND:  # hybrid from the first round to the last: one session, opened once
        assert len(opens) == 1 and gen.stats.cloud_streams == 0 and gen.stats.reopens == 0
    else:  # each cloud-only stream opens its own session, each hybrid stretch one more
        assert gen.stats.cloud_streams <= len(opens) <= 2 * gen.stats.cloud_streams
