"""The edge worker: draft, get verified, commit — and decide when the cloud is better left alone.

A generation moves between three phases (edge/controller.py decides between the first two):
    hybrid      draft a block (γ from measured rates), verify it, commit; maybe draft the next meanwhile (here)
    cloud-only  the target decodes alone, streamed from its replica (edge/cloud_only.py)
    offline     the cloud is unreachable and `allow_unverified` is on: the drafter continues alone,
                then its tokens are verified or rolled back (edge/offline.py)
Committed tokens never change (edge/state.py). Events report progress to a caller that streams text.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..common.protocol.errors import FailedPrecondition, HybridSpecError, Unavailable
from ..common.protocol.wire import FeatureFormat, ModelInfo, SessionSpec, check_context
from .client import VerifierClient
from .cloud_only import run_cloud_only
from .config import EdgeConfig, GammaPolicy
from .controller import Controller, Phase, Policy
from .estimates import Estimates
from .offline import run_offline
from .proposal import SHADOW_SAMPLED_MODES, DrafterKind, Proposal
from .rounds import InFlight, VerifyRound
from .session import CloudSession
from .startup import DrafterLoad
from .state import Event, EventKind, GenerationState, Origin
from .stats import Stats
from .stops import TextTracker
from .textcodec import HFCodec, TextCodec

if TYPE_CHECKING:
    from ..common.models.loading import LoadedModel
    from .drafter import Lookahead


@dataclass
class Generation:
    """What a finished generation returns (also after a failure: what was committed before it)."""

    token_ids: list[int]  # generated tokens only, EOS included when reached
    origins: list[Origin]  # one per token
    stats: Stats
    text: str = ""  # the generated text, cut before a stop string
    finished_by_eos: bool = False
    finish_reason: str = "length"  # "stop": an end-of-sequence token or a stop string; "length": the budget
    error: str = ""  # why the generation ended early ("" when it did not)


class EdgeWorker:
    """Runs generations against one verifier pool with one drafter; keeps its measurements across them.

    Generations may run concurrently from several threads: each leases a connection of its own (a
    session's rounds share one gRPC stream) and builds its own drafter state; the drafter's weights
    and the measured rates are shared.
    """

    def __init__(self, drafter: LoadedModel | DrafterLoad, client: VerifierClient, config: EdgeConfig,
                 fallback_model: LoadedModel | None = None, codec: TextCodec | HFCodec | None = None,
                 require_cloud: bool = True) -> None:
        """drafter: a loaded model, or one still loading (generations start cloud-only meanwhile);
        fallback_model: for an eagle head, the plain drafter used while it has no features (else n-gram);
        codec: the tokenizer without torch (default: the drafter's own, once loaded);
        require_cloud: fail now if the cloud is unreachable, unless `config.allow_unverified`."""
        self.load = drafter if isinstance(drafter, DrafterLoad) else DrafterLoad.loaded(drafter, fallback_model)
        self.codec = codec or HFCodec(self.load.get()[0].tokenizer)
        self.tokenizer_fp = self.codec.fingerprint()
        self.client = client
        self.config = config
        self._lock = threading.Lock()
        self._clients = [client]  # every connection opened, closed by close()
        self._idle = [client]  # connections no generation holds right now
        self.info: ModelInfo | None = None  # the verifier's, once it answered
        self.cap = config.max_draft
        # Rates carry over between generations: the link, the drafter and the cloud stay the same.
        self.estimates = Estimates(self.cap + 1)
        try:
            self.connect()
        except Unavailable:
            if require_cloud and not config.allow_unverified:
                raise

    @property
    def drafter_model(self) -> LoadedModel:
        """The drafter (waits for it while it loads)."""
        return self.load.get()[0]

    @property
    def fallback_model(self) -> LoadedModel | None:
        """An eagle head's plain fallback drafter, if one was loaded."""
        return self.load.get()[1]

    @property
    def connected(self) -> bool:
        """The verifier answered at least once."""
        return self.info is not None

    def connect(self, client: VerifierClient | None = None) -> ModelInfo:
        """Ask the verifier what it serves and check the drafter matches it; Unavailable if it does not answer."""
        client = client or self.client
        info = client.model_info()
        if self.tokenizer_fp != info.tokenizer_fingerprint:
            raise FailedPrecondition(
                f"the drafter's tokenizer ({self.tokenizer_fp}) differs from the verifier's "
                f"({info.tokenizer_fingerprint}); drafter and target must share one tokenizer")
        if self.load.ready():
            model = self.drafter_model
            if model.is_eagle and info.feature_dim not in (0, model.model.hidden_size):
                raise FailedPrecondition(
                    f"the eagle head reads features of size {model.model.hidden_size}; the verifier's target "
                    f"has {info.feature_dim}: the head was trained for another target")
        self.estimates.rtt_s.add(client.ping())  # the first call above also set the connection up
        self.estimates.use_pass_costs(info.pass_costs)
        self.info, self.cap = info, min(self.config.max_draft, info.max_draft)
        return info

    def local_info(self) -> ModelInfo:
        """What the edge assumes about the target while the cloud has never answered: the drafter's
        vocabulary and end-of-sequence tokens (they share the tokenizer)."""
        model = self.drafter_model
        return ModelInfo(model_name="", vocab_size=max(model.vocab_size, len(model.tokenizer)),
                         tokenizer_fingerprint=self.tokenizer_fp, model_fingerprint="", max_context=0,
                         max_draft=self.config.max_draft, max_sessions=0, idle_timeout_s=0,
                         eos_token_ids=model.eos_token_ids)

    def generate(self, prompt_ids: list[int], config: EdgeConfig | None = None) -> Generation:
        """Generate up to config.max_new_tokens tokens after `prompt_ids`."""
        run = self.stream(prompt_ids, config)
        for _ in run:
            pass
        return run.generation

    def stream(self, prompt_ids: list[int], config: EdgeConfig | None = None) -> GenerationRun:
        """The same generation as an iterator of Events; `.generation` is set once it ends.
        config: this generation's settings (default: the worker's)."""
        return GenerationRun(self, list(prompt_ids), config or self.config)

    def lease(self) -> VerifierClient:
        """A connection for one generation (give it back with `release`)."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
            client = VerifierClient(self.client.address, self.client.timeout_s, self.client.access)
            self._clients.append(client)
            return client

    def release(self, client: VerifierClient) -> None:
        """A generation is done with its connection."""
        with self._lock:
            self._idle.append(client)

    def close(self) -> None:
        """Close every connection."""
        with self._lock:
            for client in self._clients:
                client.close()


class GenerationRun:
    """One generation, driven by iterating it."""

    def __init__(self, worker: EdgeWorker, prompt: list[int], cfg: EdgeConfig) -> None:
        cfg = self.cfg = cfg.resolved()  # the rule named, a seed drawn if none was given
        self.worker = worker
        self.client = worker.lease()
        self.tokenizer_fp = worker.tokenizer_fp
        self.estimates = worker.estimates
        self.prompt = prompt
        try:
            self.info = worker.info if worker.connected else worker.connect(self.client)
            check_context(len(prompt), cfg.max_new_tokens, self.info.max_context)  # before any work
        except Unavailable:
            if not cfg.allow_unverified:
                worker.release(self.client)
                raise
            self.info = worker.local_info()  # offline from the start: the drafter's own view
        except BaseException:
            worker.release(self.client)
            raise
        cap = min(cfg.max_draft, worker.cap)
        self.text = TextTracker(worker.codec, cfg.stop)
        self.state = GenerationState(prompt, cfg.max_new_tokens, frozenset(self.info.eos_token_ids), self.text)
        self.stats = Stats()
        self.controller = Controller(Policy(cap=cap, adaptive=cfg.gamma_policy is GammaPolicy.ADAPTIVE,
                                            fixed_tree=cfg.gamma_policy is GammaPolicy.TREE,
                                            pipeline=cfg.pipeline, cloud_only_switch=cfg.cloud_only_switch,
                                            probe_tokens=cfg.probe_tokens, cloud_only=cfg.cloud_only,
                                            tree_nodes=self._tree_nodes(), tree_top_k=cfg.tree_top_k),
                                     self.estimates)
        self._drafter: Lookahead | None = None  # built once the drafter model is there
        self.eagle = None  # the EagleDrafter, when the drafter is an eagle head
        self.session: CloudSession | None = None
        self.verify_round: VerifyRound | None = None
        self.phase = Phase.HYBRID
        self.lost_reason = ""  # why the cloud was last lost
        self.in_flight: Proposal | None = None  # the block that was being verified when it was
        self.gave_up = False  # the cloud stayed unreachable: the unverified tail is the end
        self.error = ""
        self.generation: Generation | None = None
        self._build_session()

    def _tree_nodes(self) -> int:
        """The tree budget this generation may use: 0 unless the server verifies trees, the rule has a
        tree form and a model drafts (an eagle head, found once it loads, drafts chains)."""
        cfg = self.cfg
        if cfg.drafter_kind is not DrafterKind.MODEL or not cfg.resolved_mode.verifies_trees:
            return 0
        return min(cfg.tree_nodes, self.info.max_tree_nodes)

    def drafter_ready(self) -> bool:
        """The drafter model has loaded (a worker started in the background may still be loading it)."""
        return self.worker.load.ready()

    @property
    def drafter(self) -> Lookahead:
        """This generation's drafter (waits for the model while it loads)."""
        if self._drafter is None:
            self._build_drafter()
        return self._drafter

    @property
    def can_shadow(self) -> bool:
        """Whether the drafter can guess along with cloud-only decoding (a plain model drafter, at
        temperature 0 or under a rule SHADOW_SAMPLED_MODES names)."""
        sampled_ok = self.cfg.resolved_mode in SHADOW_SAMPLED_MODES
        if not ((self.cfg.sampling.greedy or sampled_ok) and self.drafter_ready()):
            return False  # and no torch import here while another thread may be importing it
        from .drafter import ModelDrafter

        return isinstance(self.drafter.inner, ModelDrafter) and self.eagle is None

    def _build_drafter(self) -> None:
        model, fallback = self.worker.load.get()  # first: it may still be importing torch on its thread
        from .drafter import Lookahead, ModelDrafter
        from .drafters import make_drafter
        from .eagle import EagleDrafter

        cfg = self.cfg
        settings = cfg.draft_settings(self.info.vocab_size, frozenset(self.info.eos_token_ids), len(self.prompt))
        inner = make_drafter(cfg.drafter_kind, model, settings, fallback)
        self._drafter = Lookahead(inner)
        # An eagle head gets features only from verify rounds, so it cannot guess alongside cloud-only
        # decoding, and it drafts chains.
        self.eagle = inner if isinstance(inner, EagleDrafter) else None
        if self.eagle is not None or not isinstance(inner, ModelDrafter):
            self.controller.policy = replace(self.controller.policy, tree_nodes=0)
        self._build_session()  # no session is open yet: hybrid decoding needs the drafter first
        self.verify_round = VerifyRound(self.state, self.stats, self._drafter, self.session.send,
                                        with_q=cfg.resolved_mode.uses_draft_probs,
                                        features=self.eagle.log if self.eagle else None, take=self.session.verdict)

    def open_hybrid(self) -> None:
        """Get ready for verify rounds: the drafter (waiting for it if it still loads), then the session."""
        if self._drafter is None:
            self._build_drafter()  # and the session an eagle drafter needs
        self.session.open()

    def _build_session(self) -> None:
        """The cloud session; an eagle drafter's asks for the target's features."""
        cfg, prompt = self.cfg, self.prompt
        log = self.eagle.log if self.eagle else None
        spec = SessionSpec(session_id="", committed_ids=tuple(prompt), sampling=cfg.sampling, mode=cfg.resolved_mode,
                           seed=cfg.seed, rollback_threshold=cfg.rollback_threshold, lenience=cfg.lenience,
                           tokenizer_fingerprint=self.tokenizer_fp, prompt_len=len(prompt),
                           features=FeatureFormat(cfg.features) if log else FeatureFormat.NONE)
        self.session = CloudSession(self.client, spec, self.state, self.estimates, self.stats, cfg.timeout_s, log)

    def __iter__(self) -> Iterator[Event]:
        start = time.perf_counter()
        up0, down0 = self.client.uplink_bytes, self.client.downlink_bytes
        try:
            yield from self._run()
            yield Event(EventKind.COMMIT, text=self.text.finish())  # text held back for a stop string
        except HybridSpecError as exc:
            self.error = str(exc)
            raise
        finally:
            end = time.perf_counter()  # the last token is out: closing the session is not waited for
            if not self.gave_up:
                self.session.close()  # nothing to do unless a session is open
            self._finish(end - start, up0, down0)
            self.worker.release(self.client)

    def _finish(self, wall_s: float, up0: int, down0: int) -> None:
        tokens, origins = self.state.result()
        s = self.stats
        s.new_tokens, s.unverified = len(tokens), len(self.state.unverified)
        s.predrafted = self._drafter.predrafted if self._drafter else 0
        s.uplink_bytes = self.client.uplink_bytes - up0
        s.downlink_bytes = self.client.downlink_bytes - down0
        s.feature_bytes = self.eagle.log.received_bytes if self.eagle else 0
        s.wall_s = wall_s
        text = self.text.text + self.text.continuation(self.state.unverified)
        reason = "stop" if self.state.eos or self.text.stopped else "length"
        self.generation = Generation(tokens, origins, s, text, self.state.eos, reason, self.error)

    def _run(self) -> Iterator[Event]:
        # 1. Start where the measurements point: cloud-only while warming up, while the drafter still
        #    loads, or when it is faster; offline if the cloud has never answered.
        self.phase = self.controller.initial_phase()
        if self.phase is Phase.HYBRID and self.cfg.cloud_only_switch and not self.drafter_ready():
            self.phase = Phase.CLOUD_ONLY
        if self.phase is Phase.CLOUD_ONLY and not (self.controller.warming_up or self.cfg.cloud_only
                                                   or not self.drafter_ready()):
            yield self.notice("starting with cloud-only decoding: the edge's measurements favour it")
        if not self.worker.connected:
            self.phase = self.lost(Unavailable(f"the verifier at {self.client.address} did not answer"), None)
        elif self.phase is Phase.HYBRID:
            try:
                self.open_hybrid()
            except Unavailable as exc:
                self.phase = self.lost(exc, None)
        # 2. Run phases until the budget is spent, an end-of-sequence token or a stop string came, or
        #    the cloud is gone.
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
        if self._drafter is not None:
            self._drafter.drop()
        return Phase.OFFLINE

    def _hybrid_round(self) -> Generator[Event, None, Phase]:
        state = self.state
        # 1. Decide: a chain of γ, a tree, or let the cloud decode alone. The verifier always adds a token.
        shape = self.controller.next_shape(state.max_new_tokens - state.generated, len(state.committed))
        if shape is None:
            yield self._to_cloud_only("hybrid is predicted slower than cloud-only decoding")
            return Phase.CLOUD_ONLY
        depth = min(shape.depth, state.max_new_tokens - state.generated - 1)
        # 2. Draft (unless the last wait already did).
        t0 = time.perf_counter()
        if shape.is_chain or depth == 0:  # the last token of the budget is the verifier's alone
            proposal = self.drafter.propose(state.committed, depth)
        else:
            from .tree_draft import TreeBudget, draft_tree  # with the drafter: a tree needs its torch

            budget = TreeBudget(shape.nodes, depth, shape.top_k)
            proposal = self.drafter.propose_tree(depth, lambda inner: draft_tree(inner, state.committed, budget))
        yield from self.drafter_notice()
        if not proposal.drafted_ahead:
            spent = time.perf_counter() - t0
            self.stats.draft_s += spent
            if proposal.ids:
                per_token = self.estimates.draft_s if proposal.parents is None else self.estimates.tree_node_s
                per_token.add(spent / len(proposal.ids))
        if proposal.ids:
            yield Event(EventKind.DRAFT, provisional=tuple(proposal.main_path().ids))
        # 3. Verify it, drafting the next block meanwhile.
        try:
            result, events = self.verify_round(
                proposal, shape.nodes, while_waiting=lambda flight: self._draft_ahead(proposal, depth, flight))
        except Unavailable as exc:
            return self.lost(exc, proposal)
        yield from events
        # 4. Learn: acceptance per position (a tree's main path stands for the chain it contains) and
        #    per rank, the verifier's time per block size, the network's share.
        nodes, main = proposal.accepted(result), proposal.main_nodes()
        kept = next((i for i, (a, b) in enumerate(zip(nodes, main)) if a != b), min(len(nodes), len(main)))
        self.estimates.observe_round(len(main), kept, self.drafter.guess_right)
        self.estimates.observe_ranks(proposal.ranks_seen(nodes, result.next_token))
        self.estimates.observe_verify(len(proposal.ids), result.verify_ms / 1e3)
        self.controller.observed_hybrid_round()
        return Phase.HYBRID

    def _draft_ahead(self, proposal: Proposal, depth: int, flight: InFlight) -> None:
        """Pipelining: the guessed bonus token and the next block, drafted until the reply arrives,
        after the block (a tree's main path) as if all of it were accepted."""
        main = proposal.main_path()
        if not self.cfg.pipeline or depth == 0 or (main.ids and main.ids[-1] in self.state.stop_ids):
            return
        room = self.state.max_new_tokens - self.state.generated - len(main.ids) - 1
        if room >= 2:
            self.drafter.prefetch(self.state.committed, main, min(depth + 1, room), interrupt=flight.done)

    def _to_cloud_only(self, why: str) -> Event:
        self.drafter.drop()
        self.stats.switches_to_cloud += 1
        self.session.close(wait=False)
        return self.notice(f"switched to cloud-only decoding: {why}")
