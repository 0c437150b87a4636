"""The narrow view of a running generation that its phase strategies get.

The generation loop (edge/worker.py `GenerationRun`) runs one phase at a time: hybrid rounds itself,
and cloud-only decoding (edge/cloud_only.py) and drafting offline (edge/offline.py) as strategies
that take this view. They see the shared state, the measurements and the few actions they may take,
and never import the worker, so the worker can import them.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # type names only: a phase must not import the worker or the drafter's torch
    from ..common.protocol.errors import Unavailable
    from ..common.protocol.wire import ModelInfo
    from .client import VerifierClient
    from .session import CloudSession
    from .config import EdgeConfig
    from .controller import Controller, Phase
    from .drafter import Lookahead
    from .estimates import Estimates
    from .proposal import Proposal
    from .rounds import VerifyRound
    from .state import Event, GenerationState
    from .stats import Stats
    from .textcodec import TextCodec


class Connection(Protocol):
    """The worker's link to the cloud, shared by its generations."""

    codec: TextCodec

    @property
    def connected(self) -> bool:
        """The cloud answered GetModelInfo and the pair was checked."""

    def connect(self, client: VerifierClient | None = None) -> ModelInfo:
        """Ask the cloud what it serves and check the pair."""


class RunView(Protocol):
    """What a phase strategy may read and do in the generation it runs in."""

    cfg: EdgeConfig
    state: GenerationState  # the committed and unverified tokens
    stats: Stats
    controller: Controller  # the pure decisions (cloud-only or hybrid, γ)
    estimates: Estimates  # the measured rates the controller decides from
    client: VerifierClient
    worker: Connection
    tokenizer_fp: str
    lost_reason: str  # why the cloud was last lost
    in_flight: Proposal | None  # the block being verified when the cloud was lost
    gave_up: bool  # the cloud stayed unreachable: the unverified tail is the end
    verify_round: VerifyRound | None
    session: CloudSession  # the generation's hybrid session (a cloud-only stream opens its own beside it)

    @property
    def drafter(self) -> Lookahead:
        """This generation's drafter (waits for the model while it loads)."""

    @property
    def can_shadow(self) -> bool:
        """The drafter can guess along with cloud-only decoding."""

    def drafter_ready(self) -> bool:
        """The drafter model has loaded."""

    def open_hybrid(self) -> None:
        """Get ready for verify rounds: the drafter, then a session from everything committed."""

    def notice(self, message: str) -> Event:
        """A notice event for the user."""

    def drafter_notice(self) -> Iterator[Event]:
        """A notice if the drafter just fell back to something else."""

    def lost(self, exc: Unavailable, in_flight: Proposal | None) -> Phase:
        """The cloud stopped answering: OFFLINE if unverified drafting is allowed, else raise."""
