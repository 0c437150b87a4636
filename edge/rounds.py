"""One verify round, the same wherever a block is verified: hybrid decoding, the reconciliation of
tokens drafted offline, and co-located speculative decoding (lab/baselines.py).

    1. send the block          (over gRPC, or a direct call of the verifier core)
    2. work while it is scored (pipelined drafting, optional)
    3. take the verdict        (the session's: on the cloud, edge/session.py `CloudSession.verdict`,
                                which re-opens a session the verifier lost and sends the block again)
    4. check what it kept against the block (once: the caller gets the nodes), commit them, count the
       round, tell the drafter (and hand an eagle drafter the features)
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..common.protocol.tree import depths
from ..common.protocol.wire import DraftBlock, FeatureBlock, VerifyResult
from .proposal import Drafter, Proposal
from .state import Event, EventKind, GenerationState
from .stats import Stats


class InFlight(Protocol):
    """A block on its way to a verdict (on the cloud: edge/client.py's PendingRound)."""

    def done(self) -> bool:
        """True once the verdict (or an error) is in."""
        ...


class FeatureSink(Protocol):
    """Takes the target's features a reply carries (edge/eagle.py's FeatureLog)."""

    def add(self, block: FeatureBlock) -> None:
        ...


class Session(Protocol):
    """Where a generation's blocks are verified: its session on the cloud (edge/session.py
    `CloudSession`), or the verifier core called directly (lab/baselines.py)."""

    id: str  # the session id the blocks carry

    def send(self, block: DraftBlock) -> InFlight:
        """Send a block; returns it in flight."""
        ...

    def verdict(self, in_flight: InFlight) -> VerifyResult:
        """Wait for a block's verdict, recovering on the way if the session can (step 3)."""
        ...


class VerifyRound:
    """Runs rounds of one generation against one verifier."""

    def __init__(self, state: GenerationState, stats: Stats, drafter: Drafter, session: Session, with_q: bool,
                 features: FeatureSink | None = None) -> None:
        """session: where the blocks go and their verdicts come from; with_q: send each draft token's q
        (the acceptance rules that read it); features: where the target's features in replies go (an
        eagle drafter's log)."""
        self.features = features
        self.state = state
        self.stats = stats
        self.drafter = drafter
        self.session = session
        self.with_q = with_q

    def __call__(self, proposal: Proposal, gamma: int, *, while_waiting: Callable[[InFlight], None] | None = None,
                 unverified: bool = False) -> tuple[VerifyResult, list[int], list[Event]]:
        """Verify `proposal` (γ chosen: `gamma`); unverified: it is the head of the offline tail. Returns
        the verdict, the nodes it kept (checked against the proposal: `Proposal.accepted`) and the
        events of what was committed."""
        state = self.state
        # 1. Send.
        in_flight = self.session.send(proposal.block(self.session.id, state.round, len(state.committed), self.with_q))
        # 2. Work meanwhile.
        if while_waiting is not None:
            while_waiting(in_flight)
        # 3. The verdict, recovering a lost session if the session can (an explicit step, never a getter's).
        result = self.session.verdict(in_flight)
        # 4. Check what it kept, commit, count, learn.
        nodes, token = proposal.accepted(result), result.next_token
        if unverified:
            events = state.reconcile(proposal, len(nodes), token)
            self.stats.rolled_back += sum(len(e.tokens) for e in events if e.kind is EventKind.ROLLBACK)
        else:
            events = [state.commit_verdict(proposal, nodes, token)]
        self.stats.observe_round(len(proposal.ids), len(nodes), gamma, proposal.fell_back, proposal.drafted_ahead,
                                 depth=None if proposal.parents is None else max(depths(proposal.parents), default=0))
        if result.features is not None and self.features is not None:
            self.features.add(result.features)
        self.drafter.observe([proposal.ids[n] for n in nodes], token)
        return result, nodes, events
