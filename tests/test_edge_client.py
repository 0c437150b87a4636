"""The edge's gRPC client under refusals: a round pipelined behind a refused one fails with the
stream's error at once, and streams the server ended leave no thread behind. A real localhost server."""
import collections
import threading

import pytest

from hybridspec.cloud.api.server import BackgroundServer
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.common.protocol.errors import HybridSpecError
from hybridspec.common.protocol.wire import DraftBlock, GenerateSpec, SessionSpec
from hybridspec.edge.client import VerifierClient

from conftest import eventually
from test_batched_verification import slow_engine

TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def server(target):
    srv = BackgroundServer(Verifier(target, VerifierLimits(max_context=512)))
    yield srv
    srv.stop()


def test_a_round_pipelined_behind_a_refused_one_fails_at_once(server):
    """The reader thread can end the stream (the server refused round 1) between `submit` seeing the
    stream alive and adding round 2 to the rounds awaiting replies. Round 2 must then get the stream's
    error, not wait out the client's timeout with nobody left to answer it (its error would then say
    the cloud "did not answer"). The pause below holds `submit` at exactly that point until the reader
    is done (or, once the two are ordered by a lock, for a second), as a thread switch there does about
    once in a thousand rounds."""
    with VerifierClient(server.address, timeout_s=TIMEOUT_S) as client:
        a = client.open_session(SessionSpec("", (5, 6, 7))).session_id
        b = client.open_session(SessionSpec("", (8, 9))).session_id
        refused = client.submit(DraftBlock(a, 0, 4, (10,)))  # wrong committed_len: the stream is ended
        stream = client._stream

        class PausedPending(collections.deque):
            def append(self, item):
                reader = next(t for t in threading.enumerate() if t.name == "verify-stream")
                reader.join(1.0)
                super().append(item)

        stream.pending = PausedPending(stream.pending)
        behind = client.submit(DraftBlock(b, 0, 2, (11,)))
        for round_ in (refused, behind):
            with pytest.raises(HybridSpecError) as info:
                client.wait(round_)
            assert "did not answer" not in str(info.value)


def test_streams_the_server_ended_leave_no_thread_behind(server):
    """Every refused round ends its stream and the next round opens a new one; the old stream's
    request thread must end too (it used to wait for requests for ever: one thread per refusal)."""
    with VerifierClient(server.address, timeout_s=TIMEOUT_S) as client:
        a = client.open_session(SessionSpec("", (5, 6, 7))).session_id
        before = threading.active_count()
        for _ in range(60):
            with pytest.raises(HybridSpecError):
                client.verify(DraftBlock(a, 0, 99, (10,)))
        eventually(lambda: threading.active_count() <= before + 5, "the ended streams' threads gone")


def test_a_session_closed_without_waiting_is_freed_before_the_client_goes(target):
    """`close_session_later` is how a generation frees its session without a round trip. A client that
    is closed right after (an edge process ending, a test's `with` block) must still deliver it: the
    close used to leave on a daemon thread that the closed channel cancelled, so the session stayed on
    its replica, counting against the caller's limit and the replica's load, until it idled out."""
    verifier = Verifier(target, VerifierLimits(max_context=512))
    srv = BackgroundServer(verifier)
    try:
        for _ in range(5):
            with VerifierClient(srv.address, timeout_s=TIMEOUT_S) as client:
                opened = client.open_session(SessionSpec("", (5, 6, 7)))
                client.close_session_later(opened.session_id)
        assert verifier.stats().sessions == 0
    finally:
        srv.stop()


def test_a_prompt_whose_prefill_outlasts_the_timeout_still_opens_and_generates(target):
    """The client's timeout says when a silent cloud counts as unreachable; a cloud prefilling a long
    prompt is not silent, it is working. Found as a new user: a 2,700-token chat prompt through the
    default pool (prefill about 50 s on one CPU core) failed with DEADLINE_EXCEEDED at the edge's
    30 s. Here every pass of the engine takes twice the client's 0.25 s timeout, so a prefill outlasts
    the timeout by construction, and both calls that prefill must still be answered."""
    prompt = tuple(4 + (i * 37) % 250 for i in range(600))
    limits = VerifierLimits(max_context=1024, prefill_chunk=1024)  # a prompt in one pass
    srv = BackgroundServer(Verifier(target, limits, slow_engine(target, 2 * 0.25, limits.max_context)))
    try:
        with VerifierClient(srv.address, timeout_s=0.25) as client:
            opened = client.open_session(SessionSpec("", prompt))
            assert opened.committed_len == len(prompt)
            client.close_session_later(opened.session_id)
            assert len(list(client.generate(GenerateSpec(prompt_ids=prompt, max_new_tokens=1)))) == 1
    finally:
        srv.stop()
