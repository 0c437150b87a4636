"""Recovering a session the verifier lost is an explicit step of the round (edge/session.py
`CloudSession.verdict` / `recover`), never a side effect of reading a round's result."""
from __future__ import annotations

import pytest

from hybridspec.common.protocol.errors import FailedPrecondition
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.estimates import Estimates
from hybridspec.edge.session import CloudSession
from hybridspec.edge.state import GenerationState
from hybridspec.edge.stats import Stats

from hybridspec.lab.tinymodels import greedy_reference

PROMPT = [5, 17, 33, 80]


def test_reading_a_lost_rounds_result_changes_nothing(server, verifier, target):
    """Found reading the tree (issue 41): `Round.result` re-opened a lost session inside the getter.
    Reading a round's reply (`VerifierClient.wait`, what that getter became) now raises what the
    verifier answered, as often as it is read, and re-opens nothing; the session's `verdict` step
    re-opens it once and gets the block verified."""
    state, stats = GenerationState(list(PROMPT), 8, frozenset()), Stats()
    with VerifierClient(server.address) as client:
        session = CloudSession(client, SessionSpec("", tuple(PROMPT)), state, Estimates(8), stats, timeout_s=30)
        session.open()
        first_id = session.id
        verifier.close_session(first_id)  # as after a replica restart or eviction
        (token,) = greedy_reference(target, PROMPT, 1)
        round_ = session.send(DraftBlock(first_id, state.round, len(state.committed), (token,)))
        for _ in range(2):
            with pytest.raises(FailedPrecondition):
                client.wait(round_)
        assert stats.reopens == 0 and session.id == first_id
        assert first_id not in verifier.stats().session_ids  # nothing re-opened it behind the reader's back
        result = session.verdict(round_)
        assert stats.reopens == 1
        assert (result.num_accepted, result.committed_len) == (1, len(PROMPT) + 2)
        assert result.next_token == greedy_reference(target, PROMPT, 2)[1]
        session.close()
