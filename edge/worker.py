"""The edge worker: draft, get verified, commit — and decide when the cloud is better left alone.

A generation moves between three phases (edge/controller.py decides between the first two):
    hybrid      draft a block (γ from measured rates), verify it, commit; maybe draft the next meanwhile
                (edge/hybrid.py)
    cloud-only  the target decodes alone, streamed from its replica (edge/cloud_only.py)
    offline     the cloud is unreachable and `allow_unverified` is on: the drafter continues alone,
                then its tokens are verified or rolled back (edge/offline.py)
Each phase is a function of the generation's parts (edge/context.py) that returns the next phase; the
main loop here (`GenerationRun._run`) builds the parts, goes offline when a phase lost the cloud, and
opens the hybrid session whenever hybrid rounds (re)start. Committed tokens never change
(edge/state.py). Events report progress to a caller that streams text.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..common.protocol.errors import FailedPrecondition, HybridSpecError, Unavailable
from ..common.protocol.wire import ModelInfo, SessionSpec, check_context
from .client import VerifierClient
from .cloud_only import run_cloud_only
from .config import EdgeConfig
from .context import Drafting, GaveUp, Lost, RunContext, build_drafting
from .controller import Controller, Phase, Policy
from .estimates import Estimates
from .hybrid import hybrid_round
from .offline import Outage, go_offline, run_offline, verify_unverified
from .proposal import DrafterKind
from .startup import DrafterLoad
from .state import Event, EventKind, GenerationState, Origin
from .stats import Stats
from .stops import TextTracker
from .textcodec import HFCodec, TextCodec

if TYPE_CHECKING:
    from ..common.models.loading import LoadedModel


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
        require_cloud: fail now if the cloud is unreachable, unless `config.link.allow_unverified`."""
        self.load = drafter if isinstance(drafter, DrafterLoad) else DrafterLoad.loaded(drafter, fallback_model)
        self.codec = codec or HFCodec(self.load.get()[0].tokenizer)
        self.tokenizer_fp = self.codec.fingerprint()
        self.client = client
        self.config = config
        self._lock = threading.Lock()
        self._clients = [client]  # every connection opened, closed by close()
        self._idle = [client]  # connections no generation holds right now
        self.info: ModelInfo | None = None  # the verifier's, once it answered
        self.cap = config.policy.max_draft
        # Rates carry over between generations: the link, the drafter and the cloud stay the same.
        self.estimates = Estimates(self.cap + 1)
        try:
            self.connect()
        except Unavailable:
            if require_cloud and not config.link.allow_unverified:
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
        self.estimates.use_pass_costs(info.pass_costs, info.batch_pass_costs)
        self.info, self.cap = info, min(self.config.policy.max_draft, info.max_draft)
        return info

    def local_info(self) -> ModelInfo:
        """What the edge assumes about the target while the cloud has never answered: the drafter's
        vocabulary and end-of-sequence tokens (they share the tokenizer)."""
        model = self.drafter_model
        return ModelInfo(model_name="", vocab_size=max(model.vocab_size, len(model.tokenizer)),
                         tokenizer_fingerprint=self.tokenizer_fp, model_fingerprint="", max_context=0,
                         max_draft=self.config.policy.max_draft, max_sessions=0, idle_timeout_s=0,
                         eos_token_ids=model.eos_token_ids)

    def generate(self, prompt_ids: list[int], config: EdgeConfig | None = None) -> Generation:
        """Generate up to config.generation.max_new_tokens tokens after `prompt_ids`."""
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
    """One generation, driven by iterating it; `.generation` is set once it ends."""

    def __init__(self, worker: EdgeWorker, prompt: list[int], cfg: EdgeConfig) -> None:
        """Checks the prompt against the verifier before any work (a refusal opens nothing)."""
        cfg = cfg.resolved()  # the rule named, a seed drawn if none was given
        self.worker = worker
        client = worker.lease()
        try:
            info = worker.info if worker.connected else worker.connect(client)
            check_context(len(prompt), cfg.generation.max_new_tokens, info.max_context)  # before any work
        except Unavailable:
            if not cfg.link.allow_unverified:
                worker.release(client)
                raise
            info = worker.local_info()  # offline from the start: the drafter's own view
        except BaseException:
            worker.release(client)
            raise
        self.ctx = _context(worker, client, prompt, cfg, info)
        self.drafting: Drafting | None = None  # built once, when a phase first needs the drafter
        self.gave_up = False  # the cloud stayed unreachable: the unverified tail is the end
        self.error = ""  # why the generation failed, if it did
        self.generation: Generation | None = None

    def __iter__(self) -> Iterator[Event]:
        ctx = self.ctx
        start = time.perf_counter()
        up0, down0 = ctx.client.uplink_bytes, ctx.client.downlink_bytes
        try:
            yield from self._run()
            yield Event(EventKind.COMMIT, text=ctx.text.finish())  # text held back for a stop string
        except HybridSpecError as exc:
            self.error = str(exc)
            raise
        finally:
            end = time.perf_counter()  # the last token is out: closing the session is not waited for
            if self.drafting is not None and not self.gave_up:
                self.drafting.session.close()  # nothing to do unless a session is open
            self._finish(end - start, up0, down0)
            self.worker.release(ctx.client)

    def _run(self) -> Iterator[Event]:
        ctx, state, cfg, ready = self.ctx, self.ctx.state, self.ctx.cfg, self.ctx.load.ready()
        # 1. Start where the measurements point: cloud-only while warming up, while the drafter still
        #    loads, or when it is faster; offline if the cloud has never answered.
        first = ctx.controller.initial_phase()
        if first is Phase.HYBRID and cfg.policy.cloud_only_switch and not ready:
            first = Phase.CLOUD_ONLY
        if first is Phase.CLOUD_ONLY and not (ctx.controller.warming_up or cfg.policy.cloud_only or not ready):
            yield ctx.notice("starting with cloud-only decoding: the edge's measurements favour it")
        unreachable = Unavailable(f"the verifier at {ctx.client.address} did not answer")
        after: Phase | Lost = first if self.worker.connected else Lost(unreachable)
        phase: Phase | None = None  # the phase that ran last
        outage: Outage | None = None
        while not state.done:
            # 2. The cloud stopped answering: go offline, keeping the block in flight (or fail).
            if isinstance(after, Lost):
                outage = yield from go_offline(ctx, self.drafting, after)
                after = Phase.OFFLINE
            # 3. The drafter, its session and its verify round, built once: before the first phase
            #    that drafts (a cloud-only phase builds them itself for shadow drafting, after its
            #    first token: setting them up before it would hold that token back).
            if after is not Phase.CLOUD_ONLY and self.drafting is None:
                self.drafting = build_drafting(ctx)
            # 4. Recovery: hybrid rounds (re)start on a session opened from everything committed
            #    (at the start, back from cloud-only, after an outage: then the unverified tail is
            #    verified first).
            if after is Phase.HYBRID and phase is not Phase.HYBRID:
                after = yield from self._reopen(phase)
                phase = Phase.HYBRID if after is Phase.HYBRID else phase
                continue  # verifying the tail may have ended the generation
            # 5. Run the phase until it hands over.
            phase = after
            if phase is Phase.HYBRID:
                after = yield from hybrid_round(ctx, self.drafting)
            elif phase is Phase.CLOUD_ONLY:
                after, self.drafting = yield from run_cloud_only(ctx, self.drafting)
            else:
                after = yield from run_offline(ctx, self.drafting, outage)
                if isinstance(after, GaveUp):
                    self.gave_up = True
                    yield ctx.notice(after.message)
                    return

    def _reopen(self, came_from: Phase | None) -> Generator[Event, None, Phase | Lost]:
        """Open the hybrid session from the committed tokens; after an outage re-open it and verify the
        unverified tail. OFFLINE if the cloud answered a ping but not the re-open: drafting alone goes on."""
        ctx, kit = self.ctx, self.drafting
        was_warming = came_from is Phase.CLOUD_ONLY and ctx.controller.end_warmup()
        try:
            kit.session.open()
        except Unavailable as exc:
            return Phase.OFFLINE if came_from is Phase.OFFLINE else Lost(exc)
        if came_from is Phase.OFFLINE:
            return (yield from verify_unverified(ctx, kit))
        if came_from is Phase.CLOUD_ONLY:
            ctx.controller.entered_hybrid()  # the first rounds are judged optimistically again
            if not was_warming:  # leaving the warm-up is no switch
                ctx.stats.switches_to_hybrid += 1
                yield ctx.notice("switched back to hybrid decoding: predicted faster than cloud-only again")
        return Phase.HYBRID

    def _finish(self, wall_s: float, up0: int, down0: int) -> None:
        ctx, kit = self.ctx, self.drafting
        tokens, origins = ctx.state.result()
        s = ctx.stats
        s.new_tokens, s.unverified = len(tokens), len(ctx.state.unverified)
        s.predrafted = kit.drafter.predrafted if kit else 0
        s.uplink_bytes = ctx.client.uplink_bytes - up0
        s.downlink_bytes = ctx.client.downlink_bytes - down0
        s.feature_bytes = kit.eagle.log.received_bytes if kit and kit.eagle else 0
        s.wall_s = wall_s
        text = ctx.text.text + ctx.text.continuation(ctx.state.unverified)
        reason = "stop" if ctx.state.eos or ctx.text.stopped else "length"
        self.generation = Generation(tokens, origins, s, text, ctx.state.eos, reason, self.error)


def _context(worker: EdgeWorker, client: VerifierClient, prompt: list[int], cfg: EdgeConfig,
             info: ModelInfo) -> RunContext:
    """The parts of one generation every phase reads."""
    text = TextTracker(worker.codec, cfg.generation.stop)
    state = GenerationState(prompt, cfg.generation.max_new_tokens, frozenset(info.eos_token_ids), text)
    # Trees only where the server verifies them, the rule has a tree form and a model drafts (an eagle
    # head, found once it loads, drafts chains: edge/context.py build_drafting).
    trees = cfg.model.drafter_kind is DrafterKind.MODEL and cfg.resolved_mode.verifies_trees
    policy = Policy(cap=min(cfg.policy.max_draft, worker.cap), settings=cfg.policy,
                    tree_nodes=min(cfg.policy.tree_nodes, info.max_tree_nodes) if trees else 0)
    g = cfg.generation
    spec = SessionSpec(session_id="", committed_ids=tuple(prompt), sampling=cfg.sampling, mode=cfg.resolved_mode,
                       seed=g.seed, rollback_threshold=g.rollback_threshold, lenience=g.lenience,
                       tokenizer_fingerprint=worker.tokenizer_fp, prompt_len=len(prompt))
    return RunContext(cfg=cfg, info=info, spec=spec, state=state, text=text, stats=Stats(),
                      estimates=worker.estimates, controller=Controller(policy, worker.estimates), client=client,
                      link=worker, load=worker.load)
