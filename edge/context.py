"""What every phase of a generation reads, built once; and what a phase hands the main loop.

The generation loop (edge/worker.py `GenerationRun._run`) builds a `RunContext` when the generation
starts and a `Drafting` (the drafter, its session on the verifier and its verify round) the first time
a phase needs the drafter: before the first hybrid or offline phase, or inside a cloud-only phase once
the drafter model is there. Each phase is a plain function of these two (edge/hybrid.py,
edge/cloud_only.py, edge/offline.py) that yields events and returns what comes next: a `Phase`, or
`Lost` when the cloud stopped answering, or `GaveUp` when it stayed away. Nothing here imports the
worker or torch (the drafter's modules are imported only once its model has loaded).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from ..common.protocol.errors import Unavailable
from ..common.protocol.wire import FeatureFormat, ModelInfo, SessionSpec
from .client import VerifierClient
from .config import EdgeConfig
from .controller import Controller
from .estimates import Estimates
from .proposal import SHADOW_SAMPLED_MODES, Proposal
from .rounds import VerifyRound
from .session import CloudSession
from .startup import DrafterLoad
from .state import Event, EventKind, GenerationState
from .stats import Stats
from .stops import TextTracker

if TYPE_CHECKING:  # type names only: the drafter's modules import torch
    from .drafter import Lookahead
    from .eagle import EagleDrafter
    from .textcodec import HFCodec, TextCodec


class Connection(Protocol):
    """The worker's link to the cloud, shared by its generations (edge/worker.py `EdgeWorker`)."""

    codec: TextCodec | HFCodec

    @property
    def connected(self) -> bool:
        """The cloud answered GetModelInfo and the pair was checked."""

    def connect(self, client: VerifierClient | None = None) -> ModelInfo:
        """Ask the cloud what it serves and check the pair; Unavailable if it does not answer."""


@dataclass(frozen=True)
class RunContext:
    """One generation's parts, fixed for its whole life (the objects themselves keep their own state:
    the tokens in `state`, the counters in `stats`, the rates in `estimates`)."""

    cfg: EdgeConfig  # resolved: the rule named, the seed drawn
    info: ModelInfo  # the verifier's (or, offline from the start, the drafter's own view)
    spec: SessionSpec  # the generation's session settings (a cloud-only stream derives its own)
    state: GenerationState  # the committed and unverified tokens
    text: TextTracker  # the committed text, held back where a stop string may start
    stats: Stats
    estimates: Estimates  # the worker's measured rates, shared with its other generations
    controller: Controller  # the decisions: which phase, γ or a tree
    client: VerifierClient  # this generation's connection (leased from the worker)
    link: Connection  # the worker: whether the cloud ever answered, and the codec
    load: DrafterLoad  # the drafter model, possibly still loading

    def notice(self, message: str) -> Event:
        """A change of phase, in words, for the user and the stats."""
        self.stats.notices.append(message)
        return Event(EventKind.NOTICE, message=message)


@dataclass(frozen=True)
class Drafting:
    """The drafter, the hybrid session on the verifier and the verify round over both: built once per
    generation (`build_drafting`), never rebuilt."""

    drafter: Lookahead  # pipelined drafting around the drafter the config names
    eagle: EagleDrafter | None  # the same drafter when it is an eagle head (it reads the target's features)
    session: CloudSession  # opened by the main loop each time hybrid rounds (re)start
    verify_round: VerifyRound
    can_shadow: bool  # the drafter can guess along with cloud-only decoding

    def notices(self, ctx: RunContext) -> Iterator[Event]:
        """The eagle drafter's word when it hands over to its fallback drafter or takes back over."""
        if self.eagle is not None and self.eagle.notice:
            message, self.eagle.notice = self.eagle.notice, ""
            yield ctx.notice(message)


@dataclass(frozen=True)
class Lost:
    """A phase's outcome when the cloud stopped answering: the main loop goes offline or fails."""

    error: Unavailable
    in_flight: Proposal | None = None  # the block being verified when it was lost (kept, unverified)


@dataclass(frozen=True)
class GaveUp:
    """The offline phase's outcome when the cloud stayed away: the unverified tail is the end."""

    message: str  # the notice that says so


def build_drafting(ctx: RunContext) -> Drafting:
    """The drafter, its session and its verify round (waits for the drafter model while it loads)."""
    model, fallback = ctx.load.get()  # first: it may still be importing torch on its thread
    from .drafter import Lookahead, ModelDrafter
    from .drafters import make_drafter
    from .eagle import EagleDrafter

    cfg, info = ctx.cfg, ctx.info
    settings = cfg.draft_settings(info.vocab_size, frozenset(info.eos_token_ids), ctx.spec.prompt_len, info.max_context)
    inner = make_drafter(cfg.model.drafter_kind, model, settings, fallback)
    drafter = Lookahead(inner)
    # An eagle head gets features only from verify rounds, so it cannot guess alongside cloud-only
    # decoding, and it drafts chains; so does prompt lookup. Which one the checkpoint holds is known
    # only now, so the controller's tree budget is cut here.
    eagle = inner if isinstance(inner, EagleDrafter) else None
    plain = isinstance(inner, ModelDrafter) and eagle is None
    if not plain:
        ctx.controller.policy = replace(ctx.controller.policy, tree_nodes=0)
    log = eagle.log if eagle is not None else None
    spec = replace(ctx.spec, features=FeatureFormat(cfg.model.features) if log else FeatureFormat.NONE)
    session = CloudSession(ctx.client, spec, ctx.state, ctx.estimates, ctx.stats, cfg.link.timeout_s, log)
    verify_round = VerifyRound(ctx.state, ctx.stats, drafter, session, with_q=cfg.resolved_mode.uses_draft_probs,
                               features=log)
    return Drafting(drafter, eagle, session, verify_round, can_shadow=plain and shadow_rule(cfg))


def shadow_rule(cfg: EdgeConfig) -> bool:
    """Whether a shadow guess can be checked under this config's rule: at temperature 0, or under a
    rule SHADOW_SAMPLED_MODES names (and then only a plain model drafter guesses: `Drafting.can_shadow`)."""
    return cfg.sampling.greedy or cfg.resolved_mode in SHADOW_SAMPLED_MODES
