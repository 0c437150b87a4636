"""The generation's session on the verifier: opened under the id the server issues, re-opened from the
committed tokens whenever the verifier lost it (or its replica's own endpoint stopped answering: the
front door re-opens it and says where it lives now), closed at the end; and the rounds sent on it."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from ..common.protocol.errors import FailedPrecondition, HybridSpecError, Unavailable
from ..common.protocol.wire import DraftBlock, SessionSpec, VerifyResult
from .client import PendingRound, ReplicaUnreachable, VerifierClient
from .estimates import Estimates
from .rounds import FeatureSink
from .state import GenerationState
from .stats import Stats

# A verifier that lost a session because its replica died needs a few seconds to restart it; the
# re-open is retried with this backoff (seconds, doubling) until the edge's timeout runs out.
REOPEN_BACKOFF_S = (0.25, 2.0)


class CloudSession:
    """Open/re-open/close one generation's session and send its rounds."""

    def __init__(self, client: VerifierClient, spec: SessionSpec, state: GenerationState, estimates: Estimates,
                 stats: Stats, timeout_s: float, features: FeatureSink | None = None, measure_opens: bool = True) -> None:
        """spec: the session's settings; its ids and round come from `state` at each open. features:
        where the prompt's features go when the spec asks for them. measure_opens: each open's time is
        a measurement of what a switch costs (estimates.observe_open)."""
        self.client = client
        self.features = features
        self.spec = spec
        self.state = state
        self.estimates = estimates
        self.stats = stats
        self.timeout_s = timeout_s
        self.measure_opens = measure_opens
        self.id = ""  # issued by the verifier at the first open; "" while there is no session

    def open(self) -> None:
        """Open the session, or re-open it under its id, from the committed tokens."""
        self.begin_open()()

    def begin_open(self) -> Callable[[], None]:
        """Send the open now; the call returned waits for its reply and takes the session (so the
        caller's own work can overlap the cloud's prefill)."""
        t0 = time.perf_counter()
        state = self.state
        reply = self.client.begin_open(replace(self.spec, session_id=self.id, committed_ids=tuple(state.committed),
                                               next_round=state.round))

        def opened() -> None:
            answer = reply()
            self.id = answer.session_id
            if answer.features is not None and self.features is not None:
                self.features.add(answer.features)
            if self.measure_opens:
                self.estimates.observe_open(time.perf_counter() - t0, len(state.committed))

        return opened

    def reopen(self) -> None:
        """Re-open after the verifier lost the session, waiting (bounded) for a restarting replica."""
        self.stats.reopens += 1
        deadline = time.perf_counter() + self.timeout_s
        delay, max_delay = REOPEN_BACKOFF_S
        while True:
            try:
                return self.open()
            except Unavailable:
                if time.perf_counter() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(2 * delay, max_delay)

    def close(self, wait: bool = True) -> None:
        """Free the session on the verifier (a soft cache: failing to is harmless)."""
        if not self.id:
            return
        if wait:
            try:
                self.client.close_session(self.id)
            except HybridSpecError:
                pass  # the verifier expires it on its own
        else:
            self.client.close_session_later(self.id)
        self.id = ""

    def send(self, block: DraftBlock) -> PendingRound:
        """Send a round of this session on its stream (the block carries this session's `id`)."""
        return self.client.submit(block)

    def verdict(self, round_: PendingRound) -> VerifyResult:
        """Step 3 of a verify round on the cloud (edge/rounds.py): wait for `round_`'s reply, and if the
        verifier lost the session, recover (`recover`). Waiting changes nothing: the reply, or the error
        the verifier answered (FailedPrecondition if it lost the session; Unavailable if no reply came
        in time). A reply that came straight back also measures the round trip: its wait minus the
        verifier's time. All of the wait counts as cloud time."""
        t0 = time.perf_counter()
        try:
            try:
                result = self.client.wait(round_)
            except FailedPrecondition as exc:
                return self.recover(round_, exc)
            self.estimates.rtt_s.add(max(0.0, round_.arrived - round_.sent - result.verify_ms / 1e3))
            return result
        finally:
            self.stats.cloud_s += time.perf_counter() - t0

    def recover(self, round_: PendingRound, lost: FailedPrecondition) -> VerifyResult:
        """The verifier lost the session (`lost`): re-open it from the committed tokens and send the
        round's block again; returns its verdict."""
        if isinstance(lost, ReplicaUnreachable):
            # The session's replica stopped answering on its own endpoint. If the front door is gone
            # too this is an outage (Unavailable, handled as always); else re-open there.
            self.client.ping()
        self.reopen()
        return self.client.verify(replace(round_.block, session_id=self.id))
