"""The edge worker: draft, get verified, commit — and decide when the cloud is better left alone.

A generation moves between three modes:
    hybrid      draft a block (γ chosen per round from measured rates, edge/policy.py), verify it on
                the session's stream, commit; optionally draft the next block while waiting.
    cloud-only  the target decodes alone (`Generate`), chosen when that is predicted to be faster;
                every `probe_tokens` tokens the edge measures again and may switch back.
    offline     the cloud is unreachable and `allow_unverified` is on: the drafter continues alone,
                its tokens marked unverified; once the cloud answers again they are verified as
                draft blocks, the longest accepted prefix kept and the rest rolled back.
Committed tokens never change. Events report progress to a caller that streams text.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from enum import Enum

from ..common.errors import FailedPrecondition, HybridSpecError, Unavailable
from ..common.models import LoadedModel, tokenizer_fingerprint
from ..common.sampling import round_generator
from ..common.wire import DraftBlock, GenerateSpec, SamplingParams, SessionSpec, VerifyResult
from . import policy
from .client import PendingRound, VerifierClient
from .config import EdgeConfig
from .drafter import Drafter, ModelDrafter, NgramDrafter, Proposal
from .estimates import Estimates

# Until these are measured, the policy assumes them (seconds); the first rounds measure them all.
DEFAULT_RATES = policy.Rates(alphas=[0.5], draft_s=0.005, rtt_s=0.02, verify_single_s=0.03, verify_block_s=0.03,
                             verify_per_draft_s=0.002, cloud_token_s=0.03)
# With the cloud-only switch on, a worker's first generation starts with tokens decoded by the cloud
# alone: their stream times T, the cloud's cost per token as the edge sees it, and at T = 0 the
# drafter's guesses against them ("shadow drafting") measure α before any block is risked.
WARMUP_CLOUD_TOKENS = 16  # greedy: long enough for shadow acceptance to mean something
WARMUP_CLOUD_TOKENS_SAMPLED = 4  # sampling: no shadow acceptance, so hybrid is tried optimistically
# For its first hybrid rounds (after any switch) the edge leaves hybrid decoding only if it would
# lose even with this good a drafter: acceptance needs a few rounds to be known.
MIN_HYBRID_ROUNDS = 4
OPTIMISTIC_ALPHA = 0.9
FIRST_GAMMA = 4  # the adaptive policy's first block, before the drafter's speed is known
# A verifier that lost a session because its replica died needs a few seconds to restart it; the
# re-open is retried with this backoff (seconds, doubling) until the edge's timeout runs out.
REOPEN_BACKOFF_S = (0.25, 2.0)


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


@dataclass(frozen=True)
class Event:
    """One step of a generation, for streaming to a user."""

    kind: EventKind
    tokens: tuple[int, ...] = ()
    origins: tuple[Origin, ...] = ()
    provisional: tuple[int, ...] = ()  # tokens shown but not final after this event (drafts, unverified)
    message: str = ""


@dataclass
class Stats:
    """Counters of one generation; the derived rates are filled in by `finish`."""

    rounds: int = 0  # verify calls
    drafted: int = 0
    accepted: int = 0
    fallbacks: int = 0  # blocks ended early by the BiLD fallback test
    reopens: int = 0  # sessions re-opened after the verifier lost them
    new_tokens: int = 0
    cloud_only_tokens: int = 0  # tokens the cloud decoded alone
    switches_to_cloud: int = 0
    switches_to_hybrid: int = 0
    predrafted: int = 0  # tokens drafted ahead during verification (pipelining)
    pipeline_hits: int = 0  # rounds whose block had been drafted ahead
    offline_tokens: int = 0  # tokens drafted while the cloud was unreachable
    rolled_back: int = 0  # of those, rejected once the cloud was back
    unverified: int = 0  # of those, still unverified at the end
    gamma_sum: int = 0  # block lengths the policy chose, summed over rounds
    drafted_at: list[int] = field(default_factory=list)  # per draft position j: rounds that drafted it
    accepted_at: list[int] = field(default_factory=list)  # per draft position j: rounds that had it accepted
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    draft_s: float = 0.0  # time spent drafting on the critical path
    cloud_s: float = 0.0  # time waiting for the cloud
    wall_s: float = 0.0
    acceptance_rate: float = 0.0  # accepted / drafted
    mean_tokens_per_round: float = 0.0  # tokens committed by verify rounds / rounds
    mean_gamma: float = 0.0
    tokens_per_s: float = 0.0
    bytes_per_token: float = 0.0  # uplink + downlink per new token
    cloud_calls_per_token: float = 0.0  # verify rounds + cloud-only streams per new token
    cloud_streams: int = 0  # Generate calls
    notices: list[str] = field(default_factory=list)  # every mode switch, with its reason

    def finish(self, wall_s: float) -> None:
        """Fill in the derived rates."""
        self.wall_s = wall_s
        self.acceptance_rate = self.accepted / self.drafted if self.drafted else 0.0
        verified = self.new_tokens - self.cloud_only_tokens - self.unverified
        self.mean_tokens_per_round = verified / self.rounds if self.rounds else 0.0
        self.mean_gamma = self.gamma_sum / self.rounds if self.rounds else 0.0
        self.tokens_per_s = self.new_tokens / wall_s if wall_s > 0 else 0.0
        total = self.uplink_bytes + self.downlink_bytes
        self.bytes_per_token = total / self.new_tokens if self.new_tokens else 0.0
        self.cloud_calls_per_token = (self.rounds + self.cloud_streams) / self.new_tokens if self.new_tokens else 0.0

    def to_dict(self) -> dict:
        """Plain dict for JSON output."""
        return asdict(self)


@dataclass
class Generation:
    """What a finished generation returns."""

    token_ids: list[int]  # generated tokens only, EOS included when reached
    origins: list[Origin]  # one per token
    stats: Stats
    text: str = ""
    finished_by_eos: bool = False


class EdgeWorker:
    """Runs generations against one verifier pool with one drafter."""

    def __init__(self, drafter_model: LoadedModel, client: VerifierClient, config: EdgeConfig) -> None:
        self.drafter_model = drafter_model
        self.client = client
        self.config = config
        self.info = client.model_info()
        fp = tokenizer_fingerprint(drafter_model.tokenizer)
        if fp != self.info.tokenizer_fingerprint:
            raise FailedPrecondition(
                f"the drafter's tokenizer ({fp}) differs from the verifier's ({self.info.tokenizer_fingerprint}); "
                "drafter and target must share one tokenizer")
        self.tokenizer_fp = fp
        # Rates carry over between generations: the link, the drafter and the cloud stay the same.
        self.estimates = Estimates(max(min(config.max_draft, self.info.max_draft), 1) + 1)
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

    def make_drafter(self, sampling: SamplingParams) -> Drafter:
        """A fresh drafter for one generation."""
        cfg = self.config
        if cfg.drafter_kind == "ngram":
            return NgramDrafter(sampling, max_ngram=cfg.ngram_max)
        generator = None if sampling.greedy else round_generator(cfg.seed, -1)
        return ModelDrafter(self.drafter_model, sampling, self.info.vocab_size, cfg.wire_top_k, generator,
                            cfg.keep_low_confidence)


class _CloudLost(Exception):
    """The cloud stopped answering; carries the draft that was in flight, if any."""

    def __init__(self, cause: Unavailable, in_flight: Proposal | None) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.in_flight = in_flight


class GenerationRun:
    """One generation, driven by iterating it."""

    def __init__(self, worker: EdgeWorker, prompt: list[int]) -> None:
        self.w = worker
        self.cfg = worker.config
        self.client = worker.client
        self.prompt = prompt
        self.session_id = ""  # issued by the verifier when the session is opened
        self.spec = SessionSpec(session_id="", committed_ids=tuple(prompt), sampling=self.cfg.sampling,
                                mode=self.cfg.resolved_mode, seed=self.cfg.seed,
                                rollback_threshold=self.cfg.rollback_threshold, lenience=self.cfg.lenience,
                                tokenizer_fingerprint=worker.tokenizer_fp)
        self.drafter = worker.make_drafter(self.cfg.sampling)
        self.stop_ids = frozenset(worker.info.eos_token_ids)
        self.cap = min(self.cfg.max_draft, worker.info.max_draft)
        self.estimates = worker.estimates
        self.committed = list(prompt)
        self.origins: list[Origin] = []
        self.unverified: list[int] = []
        self.unverified_dists: list = []
        self.stats = Stats()
        self.round = 0
        self.hybrid_rounds = 0  # since the last switch to hybrid
        self.warming_up = self.cfg.cloud_only_switch and self.estimates.cloud_token_s.value is None
        # A worker that has measured before starts in the mode its estimates favour.
        start_in_cloud = self.warming_up or (self.cfg.cloud_only_switch and policy.prefer_cloud_only(
            self._rates(), self.cap, self.cfg.pipeline, now_cloud_only=False))
        self.mode = "cloud" if start_in_cloud else "hybrid"
        self.pre: Proposal | None = None  # the next block, drafted during the last wait
        self.eos = False
        self.gave_up = False  # the cloud stayed unreachable: the unverified tail is the end
        self.generation: Generation | None = None

    # ---- driving ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Event]:
        start = time.perf_counter()
        up0, down0 = self.client.uplink_bytes, self.client.downlink_bytes
        try:
            yield from self._run()
        finally:
            end = time.perf_counter()  # the last token is out: closing the session is not waited for
            if self.mode == "hybrid" and not self.gave_up and self.session_id:
                try:
                    self.client.close_session(self.session_id)
                except HybridSpecError:
                    pass  # a soft cache: the verifier expires it on its own
        tokens = self.committed[len(self.prompt):] + self.unverified
        origins = self.origins + [Origin.UNVERIFIED] * len(self.unverified)
        s = self.stats
        s.new_tokens = len(tokens)
        s.unverified = len(self.unverified)
        s.uplink_bytes = self.client.uplink_bytes - up0
        s.downlink_bytes = self.client.downlink_bytes - down0
        s.finish(end - start)
        text = self.w.drafter_model.tokenizer.decode(tokens, skip_special_tokens=True)
        self.generation = Generation(tokens, origins, s, text, self.eos)

    def _run(self) -> Iterator[Event]:
        if self.mode == "cloud" and not self.warming_up:
            yield self._notice("starting with cloud-only decoding: the edge's measurements favour it")
        lost = None
        try:
            if self.mode == "hybrid":
                self._open()
        except Unavailable as exc:
            lost = _CloudLost(exc, None)
        while not self._done():
            try:
                if lost is not None:
                    if not self.cfg.allow_unverified:
                        raise lost.cause from None
                    lost, current = None, lost
                    yield from self._offline(current)
                elif self.mode == "cloud":
                    yield from self._cloud_only_stream()
                else:
                    yield from self._hybrid_round()
            except _CloudLost as exc:
                lost = exc

    def _done(self) -> bool:
        return self.eos or self.gave_up or self._generated() >= self.cfg.max_new_tokens

    def _generated(self) -> int:
        return len(self.committed) - len(self.prompt)

    def _open(self) -> None:
        """Open the session (or re-open it under the id the verifier gave it) from the committed tokens."""
        t0 = time.perf_counter()
        opened = self.client.open_session(replace(self.spec, session_id=self.session_id,
                                                  committed_ids=tuple(self.committed), next_round=self.round))
        self.session_id = opened.session_id
        spent = time.perf_counter() - t0 - self.estimates.rtt_s.get(0.0)
        self.estimates.prefill_per_token_s.add(max(0.0, spent) / len(self.committed))

    def _reopen(self) -> None:
        """Re-open after the verifier lost the session, waiting (bounded) for a restarting replica."""
        self.stats.reopens += 1
        deadline = time.perf_counter() + self.cfg.timeout_s
        delay, max_delay = REOPEN_BACKOFF_S
        while True:
            try:
                return self._open()
            except Unavailable:
                if time.perf_counter() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(2 * delay, max_delay)

    def _prefer_cloud(self, rates: policy.Rates, now_cloud_only: bool) -> bool:
        """The policy's verdict, with what a switch would cost here and what is left to gain."""
        return policy.prefer_cloud_only(rates, self.cap, self.cfg.pipeline, now_cloud_only,
                                        remaining_tokens=self.cfg.max_new_tokens - self._generated(),
                                        switch_cost_s=self.estimates.switch_cost_s(len(self.committed)))

    def _rates(self) -> policy.Rates:
        return self.estimates.rates(DEFAULT_RATES)

    def _commit(self, tokens: list[int], origins: list[Origin]) -> Event:
        """Append final tokens (stopping after an end-of-sequence token)."""
        for i, token in enumerate(tokens):
            if token in self.stop_ids:
                tokens, origins = tokens[: i + 1], origins[: i + 1]
                self.eos = True
                break
        self.committed += tokens
        self.origins += origins
        return Event(EventKind.COMMIT, tuple(tokens), tuple(origins), tuple(self.unverified))

    def _notice(self, message: str) -> Event:
        self.stats.notices.append(message)
        return Event(EventKind.NOTICE, message=message)

    # ---- hybrid -----------------------------------------------------------------------------

    def _choose_gamma(self) -> int | None:
        """γ for the next round, or None to hand decoding to the cloud."""
        cfg = self.cfg
        rates = self._rates()
        if cfg.cloud_only_switch:
            judged = rates if self.hybrid_rounds >= MIN_HYBRID_ROUNDS else rates.optimistic(OPTIMISTIC_ALPHA)
            if self._prefer_cloud(judged, now_cloud_only=False):
                return None
        if cfg.gamma_policy == "fixed" or not self.cap:
            return self.cap
        if self.estimates.draft_s.value is None:
            return min(FIRST_GAMMA, self.cap)
        return policy.choose_gamma(rates, self.cap, cfg.pipeline)

    def _hybrid_round(self) -> Iterator[Event]:
        cfg = self.cfg
        # 1. Decide: a block of γ, or let the cloud decode alone. The verifier always adds a token.
        gamma = self._choose_gamma()
        if gamma is None:
            yield self._to_cloud_only("hybrid is predicted slower than cloud-only decoding")
            return
        gamma = min(gamma, self.cfg.max_new_tokens - self._generated() - 1)
        # 2. Draft, unless the last wait already did.
        if self.pre is not None and gamma > 0:
            proposal = Proposal(self.pre.ids[:gamma], None if self.pre.dists is None else self.pre.dists[:gamma],
                                self.pre.fell_back and len(self.pre.ids) <= gamma)
            self.stats.pipeline_hits += 1
        else:
            t0 = time.perf_counter()
            proposal = self.drafter.propose(self.committed, gamma, cfg.fallback_threshold, self.stop_ids)
            spent = time.perf_counter() - t0
            self.stats.draft_s += spent
            if proposal.ids:
                self.estimates.draft_s.add(spent / len(proposal.ids))
        self.pre = None
        if proposal.ids:
            yield Event(EventKind.DRAFT, provisional=tuple(proposal.ids))
        # 3. Send it; 4. meanwhile draft the block after it, guessing that all of it is accepted.
        block = self._block(proposal)
        pending = self._submit(block, proposal)
        ahead = self._draft_ahead(proposal, gamma, pending) if cfg.pipeline else None
        # 5. Wait for the verdict; a verifier that lost the session gets it back from what we hold.
        result = self._wait(pending, block, proposal)
        # 6. Commit the accepted prefix and the verifier's token.
        k = result.num_accepted
        kinds = [Origin.ACCEPTED] * k + [Origin.BONUS if k == len(proposal.ids) else Origin.CORRECTED]
        yield self._commit([*proposal.ids[:k], result.next_token], kinds)
        # 7. Learn: acceptance per position, the verifier's time per block size, the network's share.
        guess_right = None if not ahead or not ahead.ids else ahead.ids[0] == result.next_token
        self.estimates.observe_round(len(proposal.ids), k, guess_right)
        self.estimates.observe_verify(len(proposal.ids), result.verify_ms / 1e3)
        if pending.arrived:
            self.estimates.rtt_s.add(max(0.0, pending.arrived - pending.sent - result.verify_ms / 1e3))
        s = self.stats
        s.rounds += 1
        s.drafted += len(proposal.ids)
        s.accepted += k
        s.fallbacks += proposal.fell_back
        for j in range(len(proposal.ids)):
            if j == len(s.drafted_at):
                s.drafted_at.append(0)
                s.accepted_at.append(0)
            s.drafted_at[j] += 1
            s.accepted_at[j] += j < k
        s.gamma_sum += gamma
        self.round += 1
        self.hybrid_rounds += 1
        # 8. Keep the drafted-ahead block if the guess came true.
        if ahead is not None and k == len(proposal.ids) and guess_right and len(ahead.ids) > 1 and not self.eos:
            self.pre = ahead.tail(1)

    def _block(self, proposal: Proposal) -> DraftBlock:
        return proposal.block(self.session_id, self.round, len(self.committed), self.spec.mode.uses_draft_probs)

    def _submit(self, block: DraftBlock, proposal: Proposal) -> PendingRound:
        try:
            return self.client.submit(block)
        except Unavailable as exc:
            raise _CloudLost(exc, proposal) from None

    def _draft_ahead(self, proposal: Proposal, gamma: int, pending: PendingRound) -> Proposal | None:
        """The guessed bonus token and the next block after it, drafted until the reply arrives."""
        if (proposal.ids and proposal.ids[-1] in self.stop_ids) or gamma == 0:
            return None
        room = self.cfg.max_new_tokens - self._generated() - len(proposal.ids) - 1
        if room < 2:
            return None
        ahead = self.drafter.propose(self.committed + proposal.ids, min(gamma + 1, room), self.cfg.fallback_threshold,
                                     self.stop_ids, interrupt=pending.done)
        self.stats.predrafted += len(ahead.ids)
        return ahead

    def _wait(self, pending: PendingRound, block: DraftBlock, proposal: Proposal | None) -> VerifyResult:
        t0 = time.perf_counter()
        try:
            try:
                return self.client.wait(pending)
            except FailedPrecondition:
                self._reopen()
                return self.client.verify(replace(block, session_id=self.session_id))
        except Unavailable as exc:
            raise _CloudLost(exc, proposal) from None
        finally:
            self.stats.cloud_s += time.perf_counter() - t0

    # ---- cloud-only -------------------------------------------------------------------------

    def _to_cloud_only(self, why: str) -> Event:
        self.mode = "cloud"
        self.pre = None
        self.stats.switches_to_cloud += 1
        self.client.close_session_later(self.session_id)
        self.session_id = ""
        return self._notice(f"switched to cloud-only decoding: {why}")

    def _cloud_only_stream(self) -> Iterator[Event]:
        """One Generate stream for the rest of the budget, reconsidered every probe_tokens tokens
        (the first time after WARMUP_CLOUD_TOKENS) and cancelled when hybrid looks faster."""
        cfg = self.cfg
        spec = GenerateSpec(prompt_ids=tuple(self.committed), sampling=cfg.sampling,
                            max_new_tokens=cfg.max_new_tokens - self._generated(),
                            seed=cfg.seed * 1_000_003 + len(self.committed), tokenizer_fingerprint=self.w.tokenizer_fp)
        self.stats.cloud_streams += 1
        can_shadow = self._can_shadow()
        # No point measuring α for a hybrid that cannot win; while warming up, T is not known yet.
        shadow = can_shadow and (self.warming_up or self._hybrid_could_win())
        run = 0  # consecutive shadow agreements: the position a block would have reached
        last = None
        warmup = WARMUP_CLOUD_TOKENS if can_shadow else WARMUP_CLOUD_TOKENS_SAMPLED
        next_check = warmup if self.warming_up else cfg.probe_tokens
        since_check = 0
        ping = self._ping_in_background()
        stream = self.client.generate(spec)
        try:
            for token in stream:
                now = time.perf_counter()
                if last is not None:  # the first token's wait includes the round trip and the prefill
                    self.estimates.cloud_token_s.add(now - last)
                last = now
                if shadow:
                    # What the drafter would have drafted here: keeps α current while not drafting.
                    guess = self.drafter.propose(self.committed, 1, 0.0, self.stop_ids).ids
                    agreed = bool(guess) and guess[0] == token
                    self.estimates.observe_shadow(agreed, min(run, self.cap))
                    run = run + 1 if agreed and run < self.cap else 0
                self.stats.cloud_only_tokens += 1
                yield self._commit([token], [Origin.CLOUD])
                since_check += 1
                if self._done() or not cfg.probe_tokens or since_check < next_check:
                    continue
                since_check, next_check = 0, cfg.probe_tokens
                ping.join()
                ping = self._ping_in_background()
                if self._hybrid_looks_better():
                    break
                shadow = can_shadow and self._hybrid_could_win()
                if self.warming_up:
                    self.warming_up = False
                    yield self._notice("staying with cloud-only decoding: predicted faster than hybrid here")
        except Unavailable as exc:
            raise _CloudLost(exc, None) from None
        finally:
            stream.close()  # cancels the stream if we leave it early
        if self._done():
            return
        was_warming, self.warming_up = self.warming_up, False
        self._to_hybrid()
        if not was_warming:
            self.stats.switches_to_hybrid += 1
            yield self._notice("switched back to hybrid decoding: predicted faster than cloud-only again")

    def _hybrid_looks_better(self) -> bool:
        """Will hybrid be faster, as measured? While warming up without shadow acceptance (sampling),
        could it be, with a good drafter?"""
        rates = self._rates()
        judged = rates.optimistic(OPTIMISTIC_ALPHA) if self.warming_up and not self._can_shadow() else rates
        return not self._prefer_cloud(judged, now_cloud_only=True)

    def _hybrid_could_win(self) -> bool:
        """Could hybrid beat cloud-only here even with a drafter accepted OPTIMISTIC_ALPHA of the time?"""
        return not policy.prefer_cloud_only(self._rates().optimistic(OPTIMISTIC_ALPHA), self.cap, self.cfg.pipeline,
                                            now_cloud_only=True, hysteresis=0.0)

    def _can_shadow(self) -> bool:
        """Greedy decoding with a model drafter: its guesses can be checked against cloud tokens."""
        return self.cfg.sampling.greedy and isinstance(self.drafter, ModelDrafter)

    def _ping_in_background(self) -> threading.Thread:
        """Measure the round trip off the critical path (a cloud-only stream hides it otherwise)."""
        def ping() -> None:
            try:
                self.estimates.rtt_s.add(self.client.ping())
            except HybridSpecError:
                pass  # the stream itself reports an unreachable cloud

        thread = threading.Thread(target=ping, daemon=True, name="rtt-probe")
        thread.start()
        return thread

    def _to_hybrid(self) -> None:
        try:
            self._open()
        except Unavailable as exc:
            raise _CloudLost(exc, None) from None
        self.mode = "hybrid"
        self.hybrid_rounds = 0

    # ---- offline ----------------------------------------------------------------------------

    def _offline(self, lost: _CloudLost) -> Iterator[Event]:
        """Draft alone until the cloud answers again, then verify what was drafted."""
        cfg = self.cfg
        self.mode = "offline"
        self.pre = None
        yield self._notice(f"cloud unreachable ({lost.cause}); continuing with the drafter alone, unverified")
        if lost.in_flight is not None and lost.in_flight.ids:
            yield self._add_unverified(lost.in_flight)
        next_try = time.perf_counter() + cfg.reconnect_s
        give_up = None  # set once there is nothing left to draft
        while True:
            now = time.perf_counter()
            if now >= next_try:
                next_try = now + cfg.reconnect_s
                if self._reachable():
                    yield self._notice(f"cloud reachable again; verifying {len(self.unverified)} unverified tokens")
                    self.mode = "hybrid"
                    yield from self._verify_unverified()
                    return
            room = cfg.max_new_tokens - self._generated() - len(self.unverified)
            if room > 0 and not (self.unverified and self.unverified[-1] in self.stop_ids):
                proposal = self.drafter.propose(self.committed + self.unverified, 1, 0.0, self.stop_ids)
                if proposal.ids:
                    yield self._add_unverified(proposal)
                    continue
            # Nothing left to draft: wait for the cloud, but not for ever.
            give_up = give_up or now + cfg.timeout_s
            if now > give_up:
                self.gave_up = True
                yield self._notice(f"cloud still unreachable after {cfg.timeout_s:g} s; "
                                   f"{len(self.unverified)} tokens stay unverified")
                return
            time.sleep(max(0.0, min(next_try, give_up) - now))

    def _reachable(self) -> bool:
        """Ping the cloud and re-open the session; False while it does not answer."""
        try:
            self.client.ping(timeout_s=min(self.cfg.reconnect_s, self.cfg.timeout_s))
            self._open()
            return True
        except Unavailable:
            return False

    def _add_unverified(self, proposal: Proposal) -> Event:
        self.unverified += proposal.ids
        self.unverified_dists += proposal.dists or [None] * len(proposal.ids)
        self.stats.offline_tokens += len(proposal.ids)
        return Event(EventKind.UNVERIFIED, tuple(proposal.ids), (Origin.UNVERIFIED,) * len(proposal.ids),
                     tuple(self.unverified))

    def _verify_unverified(self) -> Iterator[Event]:
        """Send the unverified tail as draft blocks; keep what is accepted, roll back the rest."""
        while self.unverified:
            # The verifier adds a token after the block: leave room for it in the budget.
            n = min(self.cap, self.cfg.max_new_tokens - self._generated() - 1)
            dists = None if self.cfg.sampling.greedy else self.unverified_dists[:n]
            proposal = Proposal(self.unverified[:n], dists, False)
            block = self._block(proposal)
            result = self._wait(self.client.submit(block), block, None)
            k = result.num_accepted
            del self.unverified[:len(proposal.ids)], self.unverified_dists[:len(proposal.ids)]
            self.round += 1
            self.estimates.observe_verify(len(proposal.ids), result.verify_ms / 1e3)
            self.stats.rounds += 1
            self.stats.drafted += len(proposal.ids)
            self.stats.accepted += k
            # The verifier's token confirms the next unverified one when they are equal.
            keep_rest = k == len(proposal.ids) and self.unverified and self.unverified[0] == result.next_token
            if keep_rest:
                del self.unverified[0], self.unverified_dists[0]
            rejected = list(proposal.ids[k:]) + ([] if keep_rest else self.unverified)
            if not keep_rest:
                self.unverified, self.unverified_dists = [], []
            if rejected:
                self.stats.rolled_back += len(rejected)
                yield Event(EventKind.ROLLBACK, tuple(rejected), provisional=tuple(self.unverified))
            kinds = [Origin.ACCEPTED] * k + [Origin.BONUS if k == len(proposal.ids) else Origin.CORRECTED]
            yield self._commit([*proposal.ids[:k], result.next_token], kinds)
            if self.eos:
                self.unverified, self.unverified_dists = [], []
