"""The edge worker: draft, get verified, commit — and decide when the cloud is better left alone.

A generation moves between three phases (edge/controller.py decides between the first two):
    hybrid      draft a block (γ from measured rates), verify it on the session's stream, commit;
                optionally draft the next block while waiting (here)
    cloud-only  the target decodes alone on a `Generate` stream (edge/cloud_only.py)
    offline     the cloud is unreachable and `allow_unverified` is on: the drafter continues alone,
                then its tokens are verified or rolled back (edge/offline.py)
Committed tokens never change (edge/state.py). Events report progress to a caller that streams text.
"""
from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass

from ..common.errors import FailedPrecondition, Unavailable
from ..common.models import LoadedModel, tokenizer_fingerprint
from ..common.wire import FeatureFormat, SessionSpec
from .client import VerifierClient
from .cloud_only import run_cloud_only
from .config import EdgeConfig
from .controller import Controller, Phase, Policy
from .drafter import Lookahead, ModelDrafter, Proposal, make_drafter
from .eagle import EagleDrafter
from .estimates import Estimates
from .offline import run_offline
from .rounds import InFlight, VerifyRound
from .session import CloudSession
from .state import Event, EventKind, GenerationState, Origin
from .stats import Stats


@dataclass
class Generation:
    """What a finished generation returns."""

    token_ids: list[int]  # generated tokens only, EOS included when reached
    origins: list[Origin]  # one per token
    stats: Stats
    text: str = ""
    finished_by_eos: bool = False


class EdgeWorker:
    """Runs generations against one verifier pool with one drafter; keeps its measurements across them."""

    def __init__(self, drafter_model: LoadedModel, client: VerifierClient, config: EdgeConfig,
                 fallback_model: LoadedModel | None = None) -> None:
        """fallback_model: for an eagle head, the plain drafter used while it has no features (else n-gram)."""
        self.drafter_model = drafter_model
        self.fallback_model = fallback_model
        self.client = client
        self.config = config
        self.info = client.model_info()
        fp = tokenizer_fingerprint(drafter_model.tokenizer)
        if fp != self.info.tokenizer_fingerprint:
            raise FailedPrecondition(
                f"the drafter's tokenizer ({fp}) differs from the verifier's ({self.info.tokenizer_fingerprint}); "
                "drafter and target must share one tokenizer")
        self.tokenizer_fp = fp
        if drafter_model.is_eagle and self.info.feature_dim not in (0, drafter_model.model.hidden_size):
            raise FailedPrecondition(
                f"the eagle head reads features of size {drafter_model.model.hidden_size}; the verifier's target "
                f"has {self.info.feature_dim}: the head was trained for another target")
        self.cap = min(config.max_draft, self.info.max_draft)
        # Rates carry over between generations: the link, the drafter and the cloud stay the same.
        self.estimates = Estimates(self.cap + 1)
        self.estimates.rtt_s.add(client.ping())  # the first call above also set the connection up

    def generate(self, prompt_ids: list[int]) -> Generation:
        """Generate up to config.max_new_tokens tokens after `prompt_ids`."""
        run = self.stream(prompt_ids)
        for _ in run:
            pass
        return run.generation

    def stream(self, prompt_ids: list[int]) -> GenerationRun:
        """The same generation as an iterator of Events; `.generation` is set once it is exhausted."""
        return GenerationRun(self, list(prompt_ids))



class GenerationRun:
    """One generation, driven by iterating it."""

    def __init__(self, worker: EdgeWorker, prompt: list[int]) -> None:
        cfg = self.cfg = worker.config
        self.worker = worker
        self.client = worker.client
        self.tokenizer_fp = worker.tokenizer_fp
        self.estimates = worker.estimates
        self.state = GenerationState(prompt, cfg.max_new_tokens, frozenset(worker.info.eos_token_ids))
        self.stats = Stats()
        self.controller = Controller(Policy(cap=worker.cap, adaptive=cfg.gamma_policy == "adaptive",
                                            pipeline=cfg.pipeline, cloud_only_switch=cfg.cloud_only_switch,
                                            probe_tokens=cfg.probe_tokens, cloud_only=cfg.cloud_only),
                                     self.estimates)
        settings = cfg.draft_settings(worker.info.vocab_size, frozenset(worker.info.eos_token_ids))
        inner = make_drafter(cfg.drafter_kind, worker.drafter_model, settings, worker.fallback_model)
        self.drafter = Lookahead(inner)
        # An eagle head gets features only from verify rounds, so it cannot guess alongside cloud-only decoding.
        self.eagle = inner if isinstance(inner, EagleDrafter) else None
        self.can_shadow = cfg.sampling.greedy and isinstance(inner, ModelDrafter) and self.eagle is None
        log = self.eagle.log if self.eagle else None
        spec = SessionSpec(session_id="", committed_ids=tuple(prompt), sampling=cfg.sampling, mode=cfg.resolved_mode,
                           seed=cfg.seed, rollback_threshold=cfg.rollback_threshold, lenience=cfg.lenience,
                           tokenizer_fingerprint=worker.tokenizer_fp,
                           features=FeatureFormat(cfg.features) if log else FeatureFormat.NONE)
        self.session = CloudSession(self.client, spec, self.state, self.estimates, self.stats, cfg.timeout_s, log)
        self.verify_round = VerifyRound(self.state, self.stats, self.drafter, self.session.send,
                                        with_q=cfg.resolved_mode.uses_draft_probs, features=log)
        self.phase = Phase.HYBRID
        self.lost_reason = ""  # why the cloud was last lost
        self.in_flight: Proposal | None = None  # the block that was being verified when it was
        self.gave_up = False  # the cloud stayed unreachable: the unverified tail is the end
        self.generation: Generation | None = None

    def __iter__(self) -> Iterator[Event]:
        start = time.perf_counter()
        up0, down0 = self.client.uplink_bytes, self.client.downlink_bytes
        try:
            yield from self._run()
        finally:
            end = time.perf_counter()  # the last token is out: closing the session is not waited for
            if not self.gave_up:
                self.session.close()  # nothing to do unless a session is open
        tokens, origins = self.state.result()
        s = self.stats
        s.new_tokens, s.unverified = len(tokens), len(self.state.unverified)
        s.predrafted = self.drafter.predrafted
        s.uplink_bytes = self.client.uplink_bytes - up0
        s.downlink_bytes = self.client.downlink_bytes - down0
        s.feature_bytes = self.eagle.log.received_bytes if self.eagle else 0
        s.wall_s = end - start
        text = self.worker.drafter_model.tokenizer.decode(tokens, skip_special_tokens=True)
        self.generation = Generation(tokens, origins, s, text, self.state.eos)

    def _run(self) -> Iterator[Event]:
        # 1. Start where the measurements point: cloud-only while warming up or when it is faster.
        self.phase = self.controller.initial_phase()
        if self.phase is Phase.CLOUD_ONLY and not (self.controller.warming_up or self.cfg.cloud_only):
            yield self.notice("starting with cloud-only decoding: the edge's measurements favour it")
        if self.phase is Phase.HYBRID:
            try:
                self.session.open()
            except Unavailable as exc:
                self.phase = self.lost(exc, None)
        # 2. Run phases until the budget is spent, an end-of-sequence token came, or the cloud is gone.
        phases = {Phase.HYBRID: self._hybrid_round, Phase.CLOUD_ONLY: lambda: run_cloud_only(self),
                  Phase.OFFLINE: lambda: run_offline(self)}
        while not (self.state.done or self.gave_up):
            self.phase = yield from phases[self.phase]()

    def drafter_notice(self) -> Iterator[Event]:
        """The eagle drafter's word when it hands over to its fallback drafter or takes back over."""
        if self.eagle is not None and self.eagle.notice:
            message, self.eagle.notice = self.eagle.notice, ""
            yield self.notice(message)

    def notice(self, message: str) -> Event:
        """A change of phase, in words, for the user and the stats."""
        self.stats.notices.append(message)
        return Event(EventKind.NOTICE, message=message)

    def lost(self, exc: Unavailable, in_flight: Proposal | None) -> Phase:
        """The cloud stopped answering: go offline (keeping the block in flight), or fail."""
        if not self.cfg.allow_unverified:
            raise exc
        self.lost_reason, self.in_flight = str(exc), in_flight
        self.drafter.drop()
        return Phase.OFFLINE

    def _hybrid_round(self) -> Generator[Event, None, Phase]:
        state = self.state
        # 1. Decide: a block of γ, or let the cloud decode alone. The verifier always adds a token.
        gamma = self.controller.next_gamma(state.max_new_tokens - state.generated, len(state.committed))
        if gamma is None:
            yield self._to_cloud_only("hybrid is predicted slower than cloud-only decoding")
            return Phase.CLOUD_ONLY
        gamma = min(gamma, state.max_new_tokens - state.generated - 1)
        # 2. Draft (unless the last wait already did).
        t0 = time.perf_counter()
        proposal = self.drafter.propose(state.committed, gamma)
        yield from self.drafter_notice()
        if not proposal.drafted_ahead:
            spent = time.perf_counter() - t0
            self.stats.draft_s += spent
            if proposal.ids:
                self.estimates.draft_s.add(spent / len(proposal.ids))
        if proposal.ids:
            yield Event(EventKind.DRAFT, provisional=tuple(proposal.ids))
        # 3. Verify it, drafting the next block meanwhile.
        try:
            result, events = self.verify_round(
                proposal, gamma, while_waiting=lambda flight: self._draft_ahead(proposal, gamma, flight))
        except Unavailable as exc:
            return self.lost(exc, proposal)
        yield from events
        # 4. Learn: acceptance per position, the verifier's time per block size, the network's share.
        drafted = len(proposal.ids)
        self.estimates.observe_round(drafted, result.num_accepted, self.drafter.guess_right)
        self.estimates.observe_verify(drafted, result.verify_ms / 1e3)
        self.controller.observed_hybrid_round()
        return Phase.HYBRID

    def _draft_ahead(self, proposal: Proposal, gamma: int, flight: InFlight) -> None:
        """Pipelining: the guessed bonus token and the next block, drafted until the reply arrives."""
        if not self.cfg.pipeline or gamma == 0 or (proposal.ids and proposal.ids[-1] in self.state.stop_ids):
            return
        room = self.state.max_new_tokens - self.state.generated - len(proposal.ids) - 1
        if room >= 2:
            self.drafter.prefetch(self.state.committed, proposal, min(gamma + 1, room), interrupt=flight.done)

    def _to_cloud_only(self, why: str) -> Event:
        self.drafter.drop()
        self.stats.switches_to_cloud += 1
        self.session.close(wait=False)
        return self.notice(f"switched to cloud-only decoding: {why}")
