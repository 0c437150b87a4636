"""The cloud's own decoding of a generation, streamed from the replica that holds it.

A cloud-only stream is a session of its own (greedy, or coupled by the generation's seed, as the
cloud's Generate draws: a seed gives one text however a generation is split between streams and
rounds), opened at the front door, which issues, routes and limits it, and then decoded on the
`Decode` RPC of the replica holding it (the open's verify_address; the front door when it names none):
no token crosses the front door or Ray. The open leaves before the caller's own set-up (the drafter,
the round-trip probe), which overlaps the cloud's prefill; with the replica's prefix cache, a session
opened after a hybrid one of the same generation starts from its keys and values.

A session the verifier lost (evicted, or its replica died or stopped answering on its own port) is
re-opened at the front door from the committed tokens, waiting (bounded) for a restarting replica, and
the stream goes on where it stopped; lost twice without a token in between is an error.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from ..common.protocol.errors import FailedPrecondition, HybridSpecError
from ..common.protocol.wire import DecodeSpec, Mode, SessionSpec
from .client import ReplicaUnreachable, VerifierClient
from .estimates import Estimates
from .session import CloudSession
from .state import GenerationState
from .stats import Stats


class CloudStream:
    """One cloud-only stream of a generation: its session and the tokens decoded on it."""

    def __init__(self, client: VerifierClient, spec: SessionSpec, state: GenerationState, estimates: Estimates,
                 stats: Stats, timeout_s: float) -> None:
        """spec: the generation's session settings; the stream's rule replaces its mode (greedy, or coupled)."""
        mode = Mode.GREEDY if spec.sampling.greedy else Mode.COUPLED
        self.session = CloudSession(client, SessionSpec("", (), sampling=spec.sampling, mode=mode, seed=spec.seed,
                                                        tokenizer_fingerprint=spec.tokenizer_fingerprint,
                                                        prompt_len=spec.prompt_len),
                                    state, estimates, stats, timeout_s, measure_opens=False)
        self._client, self._state = client, state
        self._opening: Callable[[], None] | None = None
        self._round = 0  # the session's next round on the verifier: one per token decoded

    def start(self) -> None:
        """Send the open; `tokens` waits for its reply."""
        self._opening = self.session.begin_open()
        self._round = self._state.round

    def tokens(self, max_new_tokens: int) -> Iterator[int]:
        """Up to `max_new_tokens` tokens of the cloud's, as they arrive. The caller commits each token to
        the generation's state before asking for the next: a stream that is lost resumes from there."""
        state, first, lost_at = self._state, len(self._state.committed), -1
        while (done := len(state.committed) - first) < max_new_tokens:
            try:
                self._opened()
                stream = self._client.decode(DecodeSpec(self.session.id, self._round, len(state.committed),
                                                        max_new_tokens - done))
                try:
                    for token in stream:
                        self._round += 1
                        yield token
                finally:
                    stream.close()
                return  # the budget, or an end-of-sequence token
            except FailedPrecondition as exc:  # evicted, or its replica was lost
                if lost_at == len(state.committed):
                    raise
                lost_at = len(state.committed)
                if isinstance(exc, ReplicaUnreachable):
                    self._client.ping()  # the front door gone too is an outage: Unavailable
                self.session.reopen()
                self._round = state.round

    def close(self) -> None:
        """Free the session without waiting (a soft cache: failing to is harmless)."""
        if self._opening is not None:
            try:
                self._opened()
            except HybridSpecError:  # an open that failed holds nothing to free
                return
        self.session.close(wait=False)

    def _opened(self) -> None:
        if self._opening is not None:
            opening, self._opening = self._opening, None
            opening()
        elif not self.session.id:
            self.session.open()
            self._round = self._state.round
