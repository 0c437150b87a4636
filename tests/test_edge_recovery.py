"""Recovering a session the verifier lost is an explicit step of a round (edge/generation.py
`Generation._wait`, a verify round's step 5), never a side effect of reading a round's result."""
from __future__ import annotations

import pytest

from hybridspec.common.protocol.errors import FailedPrecondition
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.worker import EdgeWorker

from tinymodels import EVERY_ROUND, greedy_reference

PROMPT = [5, 17, 33, 80]
NEW = 16


def test_reading_a_lost_rounds_result_changes_nothing(server, verifier, target):
    """Found reading the tree (issue 41): `Round.result` re-opened a lost session inside the getter.
    Reading a round's reply (`VerifierClient.wait`, what that getter became) now raises what the
    verifier answered, as often as it is read, and re-opens nothing."""
    with VerifierClient(server.address) as client:
        session_id = client.open_session(SessionSpec("", tuple(PROMPT))).session_id
        verifier.close_session(session_id)  # as after a replica restart or eviction
        (token,) = greedy_reference(target, PROMPT, 1)
        round_ = client.submit(DraftBlock(session_id, 0, len(PROMPT), (token,)))
        for _ in range(2):
            with pytest.raises(FailedPrecondition):
                client.wait(round_)
        assert session_id not in verifier.stats().session_ids  # nothing re-opened it behind the reader's back


def test_a_round_on_a_lost_session_reopens_it_once_and_is_verified(server, verifier, target):
    """The generation's wait step re-opens the session from the committed tokens, once, and gets the
    block verified: the output is the target's, and the round counts once."""
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW, max_draft=4, fallback_threshold=0.0,
                           **EVERY_ROUND)
    with VerifierClient(server.address) as client:
        submit, sent = client.submit, []

        def losing_the_third(block):
            sent.append(block)
            if len(sent) == 3:
                verifier.close_session(block.session_id)  # as after a replica restart or eviction
            return submit(block)

        client.submit = losing_the_third
        gen = EdgeWorker(target, client, config).generate(PROMPT)
    assert gen.token_ids == greedy_reference(target, PROMPT, NEW)
    assert gen.stats.reopens == 1
    assert len(sent) == gen.stats.rounds + 1  # the third round's block, sent again on the re-opened session
    assert sent[3].round == sent[2].round and sent[3].committed_len == sent[2].committed_len
