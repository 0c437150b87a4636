"""One generation on the edge: its tokens, its session on the verifier, its drafter, its decisions, and
the loop that runs it — draft on the edge, verify in the cloud, commit; or leave the cloud alone.

A generation moves between three phases (`Controller` decides between the first two):
    hybrid      one verify round at a time (`Generation.hybrid_round`): 1 decide γ or a tree, 2 draft,
                3 send, 4 prefetch (draft the next block while this one is scored), 5 wait (re-open a
                session the verifier lost and send again), 6 commit, 7 learn
    cloud-only  the target decodes alone, streamed from its replica, while the drafter guesses along
                to measure whether hybrid would now be faster (`Generation.cloud_only`)
    offline     the cloud is unreachable and `allow_unverified` is on: the drafter goes on alone, and
                its tokens are verified or rolled back once the cloud answers (`Generation.offline`)
`Generation.run` is the loop over them: it builds the drafter once, opens the hybrid session whenever
hybrid rounds (re)start, and goes offline when a phase raised Unavailable. Committed tokens never
change; the events report progress to a caller that streams text.

Everything here is the generation's own state, on one object: its tokens (committed, with where each
came from; the unverified tail), its session's id, its counters (`Stats`), its drafter and what it
drafted ahead. What it shares with the other generations of its worker — the drafter's weights, the
measured rates (`Estimates`), the verifier's identity, the connections — it reads from the worker
(`Worker`). Decisions are the pure `Controller` (edge/controller.py); the gRPC client
(edge/client.py) moves wire dataclasses and nothing else. Nothing here imports torch: the drafter's
modules are imported once its model has loaded.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from ..common.protocol.errors import FailedPrecondition, HybridSpecError, Unavailable
from ..common.protocol.tree import depths
from ..common.protocol.wire import DecodeSpec, FeatureFormat, Mode, ModelInfo, OpenProgress, SessionSpec, VerifyResult
from .client import PendingRound, ReplicaUnreachable, VerifierClient
from .config import EdgeConfig
from .controller import Controller, Phase, Policy
from .estimates import Estimates
from .proposal import SHADOW_SAMPLED_MODES, Drafter, DrafterKind, Proposal
from .startup import DrafterLoad
from .stats import Stats
from .stops import TextTracker

if TYPE_CHECKING:  # type names only: the drafter's modules import torch
    from ..common.maths.sparse import SparseDist
    from .eagle import EagleDrafter
    from .textcodec import HFCodec, TextCodec

# A verifier that lost a session because its replica died needs a few seconds to restart it; the
# re-open is retried with this backoff (seconds, doubling) until the edge's timeout runs out.
REOPEN_BACKOFF_S = (0.25, 2.0)
SHADOW_UNAFFORDABLE_EVERY = 8  # cloud-only: a guess longer than the wait for its token, one token in this many still
RECONNECT_MAX_S = 10.0  # offline: the longest wait between two attempts to reach the cloud
STOP_WINDOW = 64  # offline: unverified tokens searched for a stop string


class Origin(str, Enum):
    """Where a generated token came from."""

    ACCEPTED = "accepted"  # drafted on the edge and accepted by the verifier
    CORRECTED = "corrected"  # the verifier's correction after a rejected draft token
    BONUS = "bonus"  # the verifier's extra token after a fully accepted block
    CLOUD = "cloud"  # decoded by the cloud alone (cloud-only mode)
    UNVERIFIED = "unverified"  # drafted while the cloud was unreachable and never verified


class EventKind(str, Enum):
    """What an Event reports."""

    COMMIT = "commit"  # `tokens` are final
    DRAFT = "draft"  # a block is being verified; `provisional` shows it
    UNVERIFIED = "unverified"  # offline: `tokens` were drafted alone; `provisional` holds all such tokens
    ROLLBACK = "rollback"  # unverified `tokens` were rejected and are withdrawn
    NOTICE = "notice"  # a change of mode, in `message`
    PROGRESS = "progress"  # the cloud is caching the prompt: `progress` = (tokens cached, of the total), in `message`


@dataclass(frozen=True)
class Event:
    """One step of a generation, for streaming to a user."""

    kind: EventKind
    tokens: tuple[int, ...] = ()
    origins: tuple[Origin, ...] = ()
    provisional: tuple[int, ...] = ()  # tokens shown but not final after this event (drafts, unverified)
    message: str = ""
    text: str = ""  # COMMIT: text that became final (joined, they give the generated text)
    progress: tuple[int, int] = ()  # PROGRESS: prompt tokens the cloud has cached, of the total to cache


class Worker(Protocol):
    """What a generation shares with the other generations of its worker (edge/worker.py `EdgeWorker`)."""

    estimates: Estimates  # the measured rates: the link, the drafter and the cloud stay the same
    load: DrafterLoad  # the drafter model, possibly still loading
    codec: TextCodec | HFCodec
    tokenizer_fp: str
    cap: int  # most tokens per block: the edge's and the verifier's max_draft

    @property
    def connected(self) -> bool:
        """The verifier answered and the pair was checked."""

    def connect(self, client: VerifierClient | None = None) -> ModelInfo:
        """Ask the verifier what it serves and check the pair; Unavailable if it does not answer."""

    def release(self, client: VerifierClient) -> None:
        """The generation is done with its connection."""


class Generation:
    """One generation, driven by iterating it (events); once it ended, `token_ids`, `origins`, `text`,
    `finish_reason`, `stats` and `error` say what it produced (after a failure: what was committed)."""

    def __init__(self, worker: Worker, client: VerifierClient, prompt: list[int], cfg: EdgeConfig,
                 info: ModelInfo) -> None:
        """client: this generation's connection, leased from `worker` (given back when it ends); cfg:
        resolved (the rule named, the seed drawn); info: the verifier's, or, if the cloud never
        answered, the drafter's own view (`EdgeWorker.local_info`)."""
        self.worker, self.client, self.cfg, self.info = worker, client, cfg, info
        self.estimates = worker.estimates
        # Its tokens, like a serving engine's sequence: the committed ones (prompt first) and where each
        # generated one came from, the tail drafted while the cloud was away with the q of each, the
        # next verify round, whether an end-of-sequence token was committed. Only the token
        # operations below (`_commit` ... `_reconcile`) change them.
        self.prompt = list(prompt)
        self.max_new_tokens = cfg.generation.max_new_tokens
        self.stop_ids = frozenset(info.eos_token_ids)
        self.committed = list(prompt)
        self._origins: list[Origin] = []
        self.unverified: list[int] = []
        self.unverified_q: list[SparseDist | None] = []
        self.round = 0
        self.eos = False
        self._text = TextTracker(worker.codec, cfg.generation.stop)  # final text; ends at a stop string
        # Its session on the verifier: the settings of its hybrid session (a cloud-only stream derives
        # its own), the id the server issued ("" while none is open), an open sent but not answered yet.
        g = cfg.generation
        self.spec = SessionSpec(session_id="", committed_ids=tuple(prompt), sampling=cfg.sampling,
                                mode=cfg.resolved_mode, seed=g.seed, rollback_threshold=g.rollback_threshold,
                                lenience=g.lenience, tokenizer_fingerprint=worker.tokenizer_fp, prompt_len=len(prompt))
        self.session_id = ""
        self._opening: Iterator[Event] | None = None
        # Its decisions and its counters. Trees only where the server verifies them, the rule has a tree
        # form and a model drafts (an eagle head, found once it loads, drafts chains: `_build_drafter`).
        trees = cfg.model.drafter_kind is DrafterKind.MODEL and cfg.resolved_mode.verifies_trees
        self.controller = Controller(Policy(cap=min(cfg.policy.max_draft, worker.cap), settings=cfg.policy,
                                            tree_nodes=min(cfg.policy.tree_nodes, info.max_tree_nodes) if trees else 0),
                                     worker.estimates)
        self.stats = Stats()
        # Its drafter, built once when a phase first drafts; what it drafted ahead during the last wait
        # (`_ahead`, after the block `_ahead_of`); the block being verified (kept, unverified, if the
        # cloud is lost meanwhile).
        self.drafter: Drafter | None = None
        self.eagle: EagleDrafter | None = None  # the drafter, when it is an eagle head reading the target's features
        self.can_shadow = False  # the drafter can guess along with cloud-only decoding
        self.with_q = cfg.resolved_mode.uses_draft_probs  # blocks carry each token's q (the rules that read it)
        self._ahead: Proposal | None = None
        self._ahead_of: Proposal | None = None
        self._in_flight: Proposal | None = None
        # While offline: when to try the cloud next, and when to stop waiting for it.
        self._retry_s = 0.0
        self._retry_at = 0.0
        self._give_up_at: float | None = None
        self.gave_up = False  # the cloud stayed unreachable: the unverified tail is the end
        self.error = ""  # why the generation failed, if it did

    # ---- what it produced --------------------------------------------------------------------------

    @property
    def token_ids(self) -> list[int]:
        """The generated tokens: committed (EOS included when reached), then any unverified tail."""
        return self.committed[len(self.prompt):] + self.unverified

    @property
    def origins(self) -> list[Origin]:
        """Where each of `token_ids` came from."""
        return self._origins + [Origin.UNVERIFIED] * len(self.unverified)

    @property
    def text(self) -> str:
        """The generated text, cut before a stop string (an unverified tail's text included)."""
        return self._text.text + self._text.continuation(self.unverified)

    @property
    def finish_reason(self) -> str:
        """"stop": an end-of-sequence token or a stop string ended it; "length": the budget."""
        return "stop" if self.eos or self._text.stopped else "length"

    @property
    def generated(self) -> int:
        """Committed tokens after the prompt."""
        return len(self.committed) - len(self.prompt)

    @property
    def room(self) -> int:
        """Tokens the budget still allows, counting the unverified tail as spent."""
        return self.max_new_tokens - self.generated - len(self.unverified)

    @property
    def done(self) -> bool:
        """An end-of-sequence token or a stop string was committed, or the budget is spent."""
        return self.eos or self.generated >= self.max_new_tokens or self._text.stopped

    # ---- the loop ----------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Event]:
        return self.run()

    def run(self) -> Iterator[Event]:
        """The generation's events, phase after phase, until the budget, an end-of-sequence token or a stop
        string (iterating the generation runs it). At the end, whatever ended it, its session is closed,
        its counters completed and its connection given back."""
        cfg, ctl, ready = self.cfg, self.controller, self.worker.load.ready()
        start = time.perf_counter()
        up0, down0 = self.client.uplink_bytes, self.client.downlink_bytes
        try:
            # 1. Start where the measurements point: cloud-only while warming up, while the drafter still
            #    loads, or when it is faster; offline if the cloud has never answered.
            phase = ctl.initial_phase()
            if phase is Phase.HYBRID and cfg.policy.cloud_only_switch and not ready:
                phase = Phase.CLOUD_ONLY
            if phase is Phase.CLOUD_ONLY and not (ctl.warming_up or cfg.policy.cloud_only or not ready):
                yield self._notice("starting with cloud-only decoding: the edge's measurements favour it")
            if not self.worker.connected:
                yield from self._go_offline(Unavailable(f"the verifier at {self.client.address} did not answer"))
                phase = Phase.OFFLINE
            ran: Phase | None = None  # the phase that ran last
            while not self.done and not self.gave_up:
                try:
                    # 2. The drafter, built once: before the first phase that drafts (a cloud-only phase
                    #    builds it itself for shadow drafting, after its first token: building it before
                    #    would hold that token back).
                    if phase is not Phase.CLOUD_ONLY and self.drafter is None:
                        self._build_drafter()
                    # 3. Hybrid rounds (re)start on a session opened from everything committed: at the
                    #    start, back from cloud-only, after an outage (then the unverified tail is
                    #    verified first).
                    if phase is Phase.HYBRID and ran is not Phase.HYBRID:
                        phase = yield from self._enter_hybrid(ran)
                        ran = Phase.HYBRID if phase is Phase.HYBRID else ran
                        continue  # verifying the tail may have ended the generation
                    # 4. Run the phase until it hands over (offline: or gives up on the cloud).
                    ran = phase
                    if phase is Phase.HYBRID:
                        phase = yield from self.hybrid_round()
                    elif phase is Phase.CLOUD_ONLY:
                        phase = yield from self.cloud_only()
                    else:
                        phase = yield from self.offline()
                except Unavailable as lost:
                    # 5. The cloud stopped answering: go offline, keeping the block in flight (or fail).
                    yield from self._go_offline(lost)
                    phase = Phase.OFFLINE
            yield Event(EventKind.COMMIT, text=self._text.finish())  # text held back for a stop string
        except HybridSpecError as exc:
            self.error = str(exc)
            raise
        finally:
            end = time.perf_counter()  # the last token is out: closing the session is not waited for
            if not self.gave_up:
                self._close_session()  # nothing to do unless a session is open
            self._finish(end - start, up0, down0)
            self.worker.release(self.client)

    def _enter_hybrid(self, came_from: Phase | None) -> Generator[Event, None, Phase]:
        """Open the hybrid session from the committed tokens; after an outage re-open it and verify the
        unverified tail. OFFLINE if the cloud answered a ping but not the re-open: drafting alone goes on."""
        was_warming = came_from is Phase.CLOUD_ONLY and self.controller.end_warmup()
        try:
            yield from self._begin_open(self.spec)
        except Unavailable:
            if came_from is Phase.OFFLINE:
                return Phase.OFFLINE
            raise
        if came_from is Phase.OFFLINE:
            yield from self._verify_unverified()
        elif came_from is Phase.CLOUD_ONLY:
            self.controller.entered_hybrid()  # the first rounds are judged optimistically again
            if not was_warming:  # leaving the warm-up is no switch
                self.stats.switches_to_hybrid += 1
                yield self._notice("switched back to hybrid decoding: predicted faster than cloud-only again")
        return Phase.HYBRID

    # ---- hybrid ------------------------------------------------------------------------------------

    def hybrid_round(self) -> Generator[Event, None, Phase]:
        """One verify round on the open session; returns HYBRID for another, or CLOUD_ONLY when the cloud
        should decode alone. Unavailable if the cloud stopped answering (the block stays in flight)."""
        est, drafter = self.estimates, self.drafter
        remaining = self.max_new_tokens - self.generated  # the budget left; nothing commits before step 6
        # 1. Decide: a chain of γ, a tree, or let the cloud decode alone. The verifier always adds a token.
        shape = self.controller.next_shape(remaining, len(self.committed))
        if shape is None:
            self._ahead = self._ahead_of = None
            self.stats.switches_to_cloud += 1
            self._close_session(wait=False)  # the cloud-only stream opens a session of its own
            yield self._notice("switched to cloud-only decoding: hybrid is predicted slower than cloud-only decoding")
            return Phase.CLOUD_ONLY
        depth = min(shape.depth, remaining - 1)  # the last token of the budget is the verifier's alone
        # 2. Draft, unless the last wait already drafted this block and its verdict kept it (a chain).
        t0 = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        if ahead is not None and depth > 0:
            proposal = replace(ahead.head(depth), drafted_ahead=True)
        elif shape.is_chain or depth == 0:
            proposal = drafter.propose(self.committed, depth)
        else:
            from .tree_draft import TreeBudget, draft_tree  # with the drafter: a tree needs its torch

            proposal = draft_tree(drafter, self.committed, TreeBudget(shape.nodes, depth, shape.top_k))
        yield from self._eagle_notice()
        if not proposal.drafted_ahead:
            spent = time.perf_counter() - t0
            self.stats.draft_s += spent
            if proposal.ids:
                (est.draft_s if proposal.parents is None else est.tree_node_s).add(spent / len(proposal.ids))
        main = proposal.main_path()
        if proposal.ids:
            yield Event(EventKind.DRAFT, provisional=tuple(main.ids))
        # 3. Send it on the session's stream.
        self._in_flight = proposal
        round_ = self._send(proposal)
        # 4. Prefetch: while it is scored, draft the guessed bonus token and the next block as if all of
        #    this one (a tree: its main path) were accepted, where the budget has room for them.
        room = remaining - len(main.ids) - 1
        if self.cfg.policy.pipeline and depth > 0 and room >= 2 and not (main.ids and main.ids[-1] in self.stop_ids):
            self._ahead_of = main
            self._ahead = drafter.propose(self.committed + main.ids, min(depth + 1, room), interrupt=round_.done)
            self.stats.predrafted += len(self._ahead.ids)
        # 5. Wait for the verdict (a session the verifier lost is re-opened and the block sent again).
        result = yield from self._wait(round_)
        self._in_flight = None
        # 6. Commit what it kept (checked against the block: `Proposal.accepted`) and the verifier's token.
        nodes = proposal.accepted(result)
        event = self._commit_verdict(proposal, nodes, result.next_token)
        guess_right = self._verdict_seen(proposal, nodes, shape.nodes, result)
        yield event
        # 7. Learn: acceptance per position (a tree's main path stands for the chain it contains) and
        #    per rank, the verifier's time per block size, the network's share.
        main_nodes = proposal.main_nodes()
        kept = next((i for i, (a, b) in enumerate(zip(nodes, main_nodes)) if a != b), min(len(nodes), len(main_nodes)))
        est.observe_round(len(main_nodes), kept, guess_right)
        est.observe_ranks(proposal.ranks_seen(nodes, result.next_token))
        est.observe_verify(len(proposal.ids), result.verify_ms / 1e3)
        self.controller.observed_hybrid_round()
        return Phase.HYBRID

    def _send(self, proposal: Proposal) -> PendingRound:
        """Send a block as this session's next round; its verdict arrives in the handle returned."""
        return self.client.submit(proposal.block(self.session_id, self.round, len(self.committed), self.with_q))

    def _wait(self, round_: PendingRound) -> Generator[Event, None, VerifyResult]:
        """The verdict of `round_`. If the verifier lost the session (FailedPrecondition; ReplicaUnreachable:
        its replica's own endpoint stopped answering), re-open it from the committed tokens (its progress
        as events) and send the block again. A reply that came straight back also measures the round
        trip: its wait minus the verifier's time. All of the wait counts as cloud time."""
        t0 = time.perf_counter()
        try:
            try:
                result = self.client.wait(round_)
            except FailedPrecondition as lost:
                if isinstance(lost, ReplicaUnreachable):
                    self.client.ping()  # the front door gone too is an outage: Unavailable
                yield from self._reopen(self.spec)
                return self.client.verify(replace(round_.block, session_id=self.session_id))
            self.estimates.rtt_s.add(max(0.0, round_.arrived - round_.sent - result.verify_ms / 1e3))
            return result
        finally:
            self.stats.cloud_s += time.perf_counter() - t0

    def _verdict_seen(self, proposal: Proposal, nodes: list[int], gamma: int, result: VerifyResult) -> bool | None:
        """What every verdict tells: the round's counts (γ chosen: `gamma`), the target's features to an
        eagle drafter, and the drafter the tokens kept. What was drafted ahead survives only if the
        verdict accepted exactly the block it was drafted after and confirmed its guess of the
        verifier's token; returns whether it guessed that token (None: nothing was drafted ahead)."""
        token = result.next_token
        self.stats.observe_round(len(proposal.ids), len(nodes), gamma, proposal.fell_back, proposal.drafted_ahead,
                                 depth=None if proposal.parents is None else max(depths(proposal.parents), default=0))
        if result.features is not None and self.eagle is not None:
            self.eagle.log.add(result.features)
        accepted = [proposal.ids[n] for n in nodes]
        self.drafter.observe(accepted, token)
        block, ahead, self._ahead_of, self._ahead = self._ahead_of, self._ahead, None, None
        guess_right = None if not ahead or not ahead.ids else ahead.ids[0] == token
        if block is not None and ahead is not None and guess_right and accepted == block.ids and len(ahead.ids) > 1:
            self._ahead = ahead.tail(1)
        return guess_right

    # ---- cloud-only --------------------------------------------------------------------------------

    def cloud_only(self) -> Generator[Event, None, Phase]:
        """Stream the cloud's tokens until done, or until hybrid looks faster (HYBRID: the loop opens the
        hybrid session). Meanwhile the edge keeps measuring: the cloud's time per token T, and the
        drafter's guesses against the cloud's tokens ("shadow drafting": α and the drafter's time per
        token, without risking a block; when sampling, the guess is the drafter's coupled draw, under
        the rules SHADOW_SAMPLED_MODES names). Every `probe_tokens` tokens the controller decides again.

        Shadow drafting uses the edge's idle time only: a token is guessed when the edge waited for it
        at least as long as a guess takes. A longer guess would hold the cloud's next tokens back from
        the user, and a drafter slower than the cloud would fall ever further behind the stream (a
        torch drafter on the Ray pool: stalls of 100-300 ms). One token in SHADOW_UNAFFORDABLE_EVERY is
        guessed regardless, so that α and the guess's cost are still measured. Without a drafter yet,
        it is built after the first token is handed on (once a drafter loading in the background is
        there), if the rule lets a guess be checked."""
        cfg, stats, ctl, est = self.cfg, self.stats, self.controller, self.estimates
        # 1. One stream for the rest of the budget, on a session of its own. The open leaves first and the
        #    round-trip probe overlaps it. The drafter is set up (a llama.cpp context, about 15 ms) only
        #    once the first token is out: the Decode request leaves when the stream is first read, so
        #    setting it up before held back every generation's first token (never_slower: 7 ms median,
        #    17 mean, a tenth of a 10-token generation). Later tokens are pushed meanwhile.
        stats.cloud_streams += 1
        sent = time.perf_counter()
        spec = self._stream_spec()
        self._opening = self._begin_open(spec, measure=False)
        stream = self._cloud_tokens(spec, self.max_new_tokens - self.generated)
        try:
            ping = self._probe_rtt()
            loading = ctl.reconsiders  # no guesses, no decisions until the drafter is there (never: --cloud-only)
            can_shadow, to_guess = False, 0  # to_guess: shadow guesses left in this window
            streak = 0  # consecutive shadow agreements: the position a block would have reached
            guessed_at = -1  # the committed length at the last guess (-1: none in this phase)
            last = None
            next_check, since_check = ctl.first_check_after(can_shadow), 0
            for token, waited in _waits(stream):
                if isinstance(token, Event):  # the stream's session is being opened: how far the cloud got
                    yield token
                    continue
                # 2. Measure: T from the gaps (the first token's wait holds the round trip and prefill), α by shadow.
                now = time.perf_counter()
                if last is not None:
                    est.cloud_token_s.add(now - last)
                else:
                    # What a switch to hybrid would cost: on a loaded replica seconds of queue, not the bare
                    # prefill (8 edges: a 3 s stall after a switch).
                    est.observe_open(now - sent, len(self.committed))
                last = now
                stats.cloud_only_tokens += 1
                yield self._commit([token], [Origin.CLOUD])  # the user first: guessing along can wait
                if self.done:
                    break  # a stop string ends the generation before the stream does
                guess_s = est.draft_s.value
                since_guess = len(self.committed) - guessed_at if guessed_at >= 0 else SHADOW_UNAFFORDABLE_EVERY
                affordable = guess_s is None or waited >= guess_s or since_guess >= SHADOW_UNAFFORDABLE_EVERY
                if to_guess and affordable:
                    to_guess -= 1
                    if guessed_at != len(self.committed) - 1:
                        streak = 0  # after a gap, the position a block would have reached is unknown
                    started = time.perf_counter()
                    proposal = self.drafter.propose(self.committed[:-1], 1, fallback=False)
                    if guessed_at == len(self.committed) - 1:
                        # A real draft of one token (t_d) only if the drafter had guessed the token before: a
                        # first guess also feeds it the prompt, one after a gap the tokens it did not guess.
                        est.draft_s.add(time.perf_counter() - started)
                    guessed_at = len(self.committed)
                    stats.shadow_guesses += 1
                    agreed = proposal.shadow_guess(cfg.generation.seed, len(self.committed) - 1) == token
                    est.observe_shadow(agreed, min(streak, ctl.policy.cap))
                    # Where the cloud's token stood among the drafter's choices: what sizes trees.
                    est.observe_ranks(proposal.ranks_seen([], token))
                    streak = streak + 1 if agreed and streak < ctl.policy.cap else 0
                if loading:
                    if not self.worker.load.ready():
                        continue
                    # The drafter is there: built now if it may guess along, and the warm-up starts.
                    if self.drafter is None and shadow_rule(cfg):
                        self._build_drafter()
                    loading, can_shadow = False, self.can_shadow
                    next_check, since_check = ctl.first_check_after(can_shadow), 0
                    to_guess = ctl.shadow_guesses(can_shadow, next_check)
                # 3. Decide, every so often.
                since_check += 1
                if not ctl.reconsiders or since_check < next_check:
                    continue
                since_check, next_check = 0, cfg.policy.probe_tokens
                ping.join()
                ping = self._probe_rtt()
                if ctl.hybrid_looks_better(can_shadow, self.max_new_tokens - self.generated, len(self.committed)):
                    break
                if ctl.end_warmup():
                    yield self._notice("staying with cloud-only decoding: predicted faster than hybrid here")
                to_guess = ctl.shadow_guesses(can_shadow, next_check)
        finally:
            stream.close()  # cancels the stream if we leave it early
            self._end_stream()
        # 4. Done, or back to hybrid (the loop opens a session from everything committed so far).
        return Phase.CLOUD_ONLY if self.done or ctl.policy.settings.cloud_only else Phase.HYBRID

    def _stream_spec(self) -> SessionSpec:
        """A cloud-only stream's session: the generation's sampling, greedy or coupled by its seed as the
        cloud draws (a seed gives one text however a generation is split between streams and rounds)."""
        s = self.spec
        return SessionSpec("", (), sampling=s.sampling, mode=Mode.GREEDY if s.sampling.greedy else Mode.COUPLED,
                           seed=s.seed, tokenizer_fingerprint=s.tokenizer_fingerprint, prompt_len=s.prompt_len)

    def _cloud_tokens(self, spec: SessionSpec, max_new_tokens: int) -> Iterator[int | Event]:
        """Up to `max_new_tokens` of the cloud's tokens, as they arrive, decoded by the `Decode` RPC of the
        replica holding the stream's session (the open's verify_address; the front door when it names
        none): no token crosses the front door or Ray; while the session is (re-)opened, PROGRESS events
        for the caller to pass on. The caller commits each token before asking for
        the next. A session the verifier lost (evicted, or its replica died or stopped answering on its
        own port) is re-opened at the front door from the committed tokens and the stream goes on where
        it stopped; lost twice without a token in between is an error."""
        first, lost_at, round_ = len(self.committed), -1, self.round  # round_: the session's next, one per token
        while (done := len(self.committed) - first) < max_new_tokens:
            try:
                if self._opening is not None:
                    opening, self._opening = self._opening, None
                    yield from opening
                elif not self.session_id:
                    yield from self._begin_open(spec, measure=False)
                    round_ = self.round
                stream = self.client.decode(DecodeSpec(self.session_id, round_, len(self.committed),
                                                       max_new_tokens - done))
                try:
                    for token in stream:
                        round_ += 1
                        yield token
                finally:
                    stream.close()
                return  # the budget, or an end-of-sequence token
            except FailedPrecondition as lost:  # evicted, or its replica was lost
                if lost_at == len(self.committed):
                    raise
                lost_at = len(self.committed)
                if isinstance(lost, ReplicaUnreachable):
                    self.client.ping()  # the front door gone too is an outage: Unavailable
                yield from self._reopen(spec, measure=False)
                round_ = self.round

    def _end_stream(self) -> None:
        """Free the stream's session without waiting (a soft cache: failing to is harmless)."""
        if self._opening is not None:
            opening, self._opening = self._opening, None
            try:
                for _ in opening:
                    pass
            except HybridSpecError:  # an open that failed holds nothing to free
                return
        self._close_session(wait=False)

    def _probe_rtt(self) -> threading.Thread:
        """Measure the round trip off the critical path (a cloud-only stream hides it otherwise)."""
        def ping() -> None:
            try:
                self.estimates.rtt_s.add(self.client.ping())
            except HybridSpecError:
                pass  # the stream itself reports an unreachable cloud

        thread = threading.Thread(target=ping, daemon=True, name="rtt-probe")
        thread.start()
        return thread

    # ---- offline -----------------------------------------------------------------------------------

    def _go_offline(self, lost: Unavailable) -> Iterator[Event]:
        """The cloud stopped answering (`lost`): say so and keep the block that was in flight, unverified;
        the first attempt to reach the cloud again is `reconnect_s` away. Raises `lost` itself unless
        `allow_unverified`."""
        if not self.cfg.link.allow_unverified:
            raise lost
        self._ahead = self._ahead_of = None  # whatever was drafted ahead followed a block that is not committed
        yield self._notice(f"cloud unreachable ({lost}); continuing with the drafter alone, unverified")
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and in_flight.ids:
            yield self._add_unverified(in_flight)
        self._retry_s = self.cfg.link.reconnect_s
        self._retry_at, self._give_up_at = time.perf_counter() + self._retry_s, None

    def offline(self) -> Generator[Event, None, Phase]:
        """Draft alone, the tokens marked unverified, until the cloud answers a ping (HYBRID: the loop
        re-opens the session and verifies them) — trying after `reconnect_s`, then at doubling intervals
        at most RECONNECT_MAX_S apart — or, with nothing left to draft, until `timeout_s` has passed
        (then `gave_up`: the unverified tail is the end)."""
        link = self.cfg.link
        while True:
            # 1. Time to try the cloud again?
            now = time.perf_counter()
            if now >= self._retry_at:
                self._retry_s = min(2 * self._retry_s, max(RECONNECT_MAX_S, link.reconnect_s))
                self._retry_at = now + self._retry_s
                if self._answers():
                    return Phase.HYBRID
            # 2. Draft one more token alone, while the budget allows.
            if self.room > 0 and not self._tail_ended():
                proposal = self.drafter.propose(self.committed + self.unverified, 1, fallback=False)
                yield from self._eagle_notice()
                if proposal.ids:
                    yield self._add_unverified(proposal)
                    continue
            # 3. Nothing left to draft: wait for the cloud, but not for ever.
            self._give_up_at = self._give_up_at or now + link.timeout_s
            if now > self._give_up_at:
                self.gave_up = True
                yield self._notice(f"cloud still unreachable after {link.timeout_s:g} s; "
                                   f"{len(self.unverified)} tokens stay unverified")
                return Phase.OFFLINE
            time.sleep(max(0.0, min(self._retry_at, self._give_up_at) - now))

    def _verify_unverified(self) -> Iterator[Event]:
        """Send the unverified tail as draft blocks on the re-opened session: keep what is accepted, roll
        back the rest, so the final text is still the target's. Unavailable if the cloud went away again."""
        yield self._notice(f"cloud reachable again; verifying {len(self.unverified)} unverified tokens")
        while self.unverified and not self.done:
            n = min(self.controller.policy.cap, self.max_new_tokens - self.generated - 1, len(self.unverified))
            block = Proposal(self.unverified[:n], None if self.cfg.sampling.greedy else self.unverified_q[:n], False)
            result = yield from self._wait(self._send(block))
            nodes = block.accepted(result)
            events = self._reconcile(block, len(nodes), result.next_token)
            self.stats.rolled_back += sum(len(e.tokens) for e in events if e.kind is EventKind.ROLLBACK)
            self._verdict_seen(block, nodes, len(block.ids), result)
            self.estimates.observe_verify(len(block.ids), result.verify_ms / 1e3)
            yield from events

    def _tail_ended(self) -> bool:
        """The unverified tail ends with an end-of-sequence token or holds a stop string: draft no further."""
        tail = self.unverified
        if tail and tail[-1] in self.stop_ids:
            return True
        stops = self.cfg.generation.stop
        text = self.worker.codec.decode(tail[-STOP_WINDOW:]) if stops and tail else ""
        return any(stop in text for stop in stops)

    def _answers(self) -> bool:
        """Ping the cloud, checking the pair if it never answered before; False while it does not answer."""
        try:
            self.client.ping(timeout_s=min(self.cfg.link.reconnect_s, self.cfg.link.timeout_s))
            if not self.worker.connected:
                self.worker.connect(self.client)
            return True
        except Unavailable:
            return False

    # ---- its session on the verifier ---------------------------------------------------------------

    def _begin_open(self, spec: SessionSpec, measure: bool = True) -> Iterator[Event]:
        """Send the open of a session with `spec`'s settings from the committed tokens (a re-open under its
        id when it has one) now; the iterator returned yields a PROGRESS event for each report of the
        cloud's prefill and takes the session once the reply is in (drive it with `yield from`), so the
        caller's own work can overlap the cloud's prefill. measure: the open's time is what a switch to
        hybrid costs (a cloud-only stream measures its first token's wait instead)."""
        t0 = time.perf_counter()
        opening = self.client.begin_open(replace(spec, session_id=self.session_id, committed_ids=tuple(self.committed),
                                                 next_round=self.round))

        def opened() -> Iterator[Event]:
            for update in opening.updates():
                yield self._progress(update)
            answer = opening.result()
            self.session_id = answer.session_id
            if answer.features is not None and self.eagle is not None:
                self.eagle.log.add(answer.features)
            if measure:
                self.estimates.observe_open(time.perf_counter() - t0, len(self.committed))

        return opened()

    def _reopen(self, spec: SessionSpec, measure: bool = True) -> Iterator[Event]:
        """Re-open after the verifier lost the session, waiting (bounded) for a restarting replica."""
        self.stats.reopens += 1
        deadline = time.perf_counter() + self.cfg.link.timeout_s
        delay, max_delay = REOPEN_BACKOFF_S
        while True:
            try:
                yield from self._begin_open(spec, measure)
                return
            except Unavailable:
                if time.perf_counter() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(2 * delay, max_delay)

    def _progress(self, update: OpenProgress) -> Event:
        """The cloud's word on an open's prefill, for the user (not a notice: nothing changed)."""
        message = (f"the cloud has cached {update.cached:,} of {update.total:,} prompt tokens" if update.cached
                   else f"the cloud is about to cache {update.total:,} prompt tokens")
        return Event(EventKind.PROGRESS, message=message, progress=(update.cached, update.total))

    def _close_session(self, wait: bool = True) -> None:
        """Free the session on the verifier (a soft cache: failing to is harmless)."""
        if not self.session_id:
            return
        if wait:
            try:
                self.client.close_session(self.session_id)
            except HybridSpecError:
                pass  # the verifier expires it on its own
        else:
            self.client.close_session_later(self.session_id)
        self.session_id = ""

    # ---- its tokens --------------------------------------------------------------------------------

    def _commit(self, tokens: list[int], origins: list[Origin]) -> Event:
        """Append final tokens, stopping after an end-of-sequence token or a stop string."""
        for i, token in enumerate(tokens):
            if token in self.stop_ids:
                tokens, origins = tokens[: i + 1], origins[: i + 1]
                self.eos = True
                break
        keep, text = self._text.add(list(tokens))
        tokens, origins = tokens[:keep], origins[:keep]
        self.committed += tokens
        self._origins += origins
        if self.done:
            self.unverified, self.unverified_q = [], []
        return Event(EventKind.COMMIT, tuple(tokens), tuple(origins), tuple(self.unverified), text=text)

    def _commit_verdict(self, proposal: Proposal, nodes: list[int], token: int) -> Event:
        """Commit the nodes a verify round kept of `proposal` (its accepted root path), then the verifier's
        token: a bonus when nothing more was drafted after them, else a correction; next round."""
        self.round += 1
        bonus = Origin.BONUS if proposal.is_leaf(nodes) else Origin.CORRECTED
        return self._commit([*(proposal.ids[n] for n in nodes), token], [Origin.ACCEPTED] * len(nodes) + [bonus])

    def _add_unverified(self, proposal: Proposal) -> Event:
        """Keep tokens drafted while the cloud is away, with the q each was sampled from."""
        self.stats.offline_tokens += len(proposal.ids)
        self.unverified += proposal.ids
        self.unverified_q += proposal.dists or [None] * len(proposal.ids)
        return Event(EventKind.UNVERIFIED, tuple(proposal.ids), (Origin.UNVERIFIED,) * len(proposal.ids),
                     tuple(self.unverified))

    def _reconcile(self, block: Proposal, num_accepted: int, token: int) -> list[Event]:
        """Apply a verdict on a block of the unverified tail: keep the accepted prefix and the verifier's
        token; the tail after the block survives only if the token confirms its first."""
        del self.unverified[:len(block.ids)], self.unverified_q[:len(block.ids)]
        keep_rest = num_accepted == len(block.ids) and self.unverified and self.unverified[0] == token
        if keep_rest:
            del self.unverified[0], self.unverified_q[0]
        rejected = list(block.ids[num_accepted:]) + ([] if keep_rest else self.unverified)
        if not keep_rest:
            self.unverified, self.unverified_q = [], []
        events = [Event(EventKind.ROLLBACK, tuple(rejected), provisional=tuple(self.unverified))] if rejected else []
        return events + [self._commit_verdict(block, list(range(num_accepted)), token)]

    # ---- its drafter, notices, the end -------------------------------------------------------------

    def _build_drafter(self) -> None:
        """The drafter the config names, once per generation (waits for the model while it loads)."""
        model, fallback = self.worker.load.get()  # first: it may still be importing torch on its thread
        from .drafter import ModelDrafter
        from .drafters import make_drafter
        from .eagle import EagleDrafter

        cfg, info = self.cfg, self.info
        settings = cfg.draft_settings(info.vocab_size, frozenset(info.eos_token_ids), len(self.prompt), info.max_context)
        drafter = make_drafter(cfg.model.drafter_kind, model, settings, fallback)
        # An eagle head gets features only from verify rounds, so it cannot guess alongside cloud-only
        # decoding, and it drafts chains; so does prompt lookup. Which one the checkpoint holds is known
        # only now.
        self.eagle = drafter if isinstance(drafter, EagleDrafter) else None
        plain = isinstance(drafter, ModelDrafter) and self.eagle is None
        if not plain:
            self.controller.chains_only()
        if self.eagle is not None:
            self.spec = replace(self.spec, features=FeatureFormat(cfg.model.features))
        self.can_shadow = plain and shadow_rule(cfg)
        self.drafter = drafter

    def _eagle_notice(self) -> Iterator[Event]:
        """The eagle drafter's word when it hands over to its fallback drafter or takes back over."""
        if self.eagle is not None and self.eagle.notice:
            message, self.eagle.notice = self.eagle.notice, ""
            yield self._notice(message)

    def _notice(self, message: str) -> Event:
        """A change of phase, in words, for the user and the stats."""
        self.stats.notices.append(message)
        return Event(EventKind.NOTICE, message=message)

    def _finish(self, wall_s: float, up0: int, down0: int) -> None:
        s = self.stats
        s.new_tokens, s.unverified = len(self.token_ids), len(self.unverified)
        s.uplink_bytes = self.client.uplink_bytes - up0
        s.downlink_bytes = self.client.downlink_bytes - down0
        s.feature_bytes = self.eagle.log.received_bytes if self.eagle is not None else 0
        s.wall_s = wall_s


def shadow_rule(cfg: EdgeConfig) -> bool:
    """Whether a shadow guess can be checked under this config's rule: at temperature 0, or under a rule
    SHADOW_SAMPLED_MODES names (and then only a plain model drafter guesses: `Generation.can_shadow`)."""
    return cfg.sampling.greedy or cfg.resolved_mode in SHADOW_SAMPLED_MODES


def _waits(tokens: Iterator[int | Event]) -> Iterator[tuple[int | Event, float]]:
    """Each token with the seconds the edge waited for it (next to nothing: it was already waiting)."""
    while True:
        asked = time.perf_counter()
        try:
            token = next(tokens)
        except StopIteration:
            return
        yield token, time.perf_counter() - asked
