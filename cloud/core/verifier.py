"""The verifier core: the target model, its sessions' KV pages and the verification rules.

No gRPC and no Ray here: requests and replies are the plain dataclasses of common/protocol/wire.py, errors
are the domain errors of common/protocol/errors.py. Work happens in steps (`step`): one forward pass carries
the rounds of many sessions and chunks of prompts being opened (cloud/engine/torch_engine.py). The scheduler
(cloud/core/scheduler.py) decides what goes into each step; `verify_batch` and `open_session` are the
same steps driven directly.

Integrity rules, enforced here for every caller:
- Everything a request carries is validated before any state changes.
- A round commits fully or leaves its session exactly as it was: if anything fails after the forward
  pass extended a session's cache, the cache is cut back to the committed tokens. So a cache never
  holds more than the committed tokens plus the block being scored, and one session's failure is
  never another's.
- A replayed round is answered from memory only when it is the very block that was answered.
- On a server with credentials, a session's rounds are taken only from the identity that opened it.
- An opening session becomes visible only once its whole prompt is cached.

Features (the target's final hidden states, for an edge's EAGLE drafter) go only to sessions that
asked (`SessionSpec.features`): the open's reply carries those of every committed token but the last,
each round's those of [last committed token, accepted drafts]; a replay returns the same ones.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...common.maths import verification as rules
from ...common.protocol.errors import (FailedPrecondition, HybridSpecError, InvalidArgument, PermissionDenied, ResourceExhausted,
                             incident)
from ...common.maths.features import encode_features, join_blocks
from ...common.models.loading import LoadedModel, model_fingerprint, tokenizer_fingerprint
from ...common.maths.sampling import logits_to_probs, penalize, round_generator
from ...common.protocol.wire import (DraftBlock, FeatureBlock, FeatureFormat, Mode, ModelInfo, SessionOpened, SessionSpec,
                           VerifyResult)
from ..engine.torch_engine import Engine, Feed
from ..engine.kvpool import PageTable
from .session import Session, SessionStore
from .telemetry import ReplicaTelemetry, Telemetry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifierLimits:
    """Per-replica limits; requests beyond them get an explicit status."""

    max_context: int = 4096  # committed + draft tokens per session
    max_draft: int = 32  # longest block accepted
    max_sessions: int = 64  # sessions held at once; more get RESOURCE_EXHAUSTED
    idle_timeout_s: int = 600  # an idle session is dropped after this
    kv_cache_tokens: int = 65536  # the KV pool, allocated once; when full, LRU sessions are evicted
    prefill_chunk: int = 128  # prompt tokens per step at most (the scheduler feeds less while others wait)


@dataclass(frozen=True)
class VerifierStats:
    """Counters a replica reports to the front door's metrics."""

    sessions: int
    cached_tokens: int
    evictions: int
    session_ids: tuple[str, ...] = ()  # the sessions held right now, for the front door's routing table
    kv_capacity_tokens: int = 0  # what the KV pool holds in all
    telemetry: ReplicaTelemetry | None = None  # time to first token, inter-token latency, step sizes, KV fill


class OpenPhase(enum.Enum):
    """Where an opening session stands."""

    FEEDING = "feeding"  # prompt chunks still to run
    OPEN = "open"  # cached and visible
    FAILED = "failed"  # its error is in `error`; its pages are freed


class Opening:
    """A session being opened: its prompt is fed chunk by chunk; it is visible only when complete."""

    def __init__(self, spec: SessionSpec, table: PageTable) -> None:
        self.spec = spec
        self.table = table
        self.context = spec.committed_ids[:-1]  # the last token is fed with the first block
        self.phase = OpenPhase.FEEDING
        self.error: HybridSpecError | None = None
        self.features: list[FeatureBlock] = []  # asked-for features of the chunks cached so far
        self.started = time.monotonic()

    def opened(self) -> SessionOpened:
        """The answer to the open, once it is OPEN: its length and the features of its context."""
        return SessionOpened(self.spec.session_id, len(self.spec.committed_ids),
                             features=join_blocks(self.features) if self.features else None)

    @property
    def remaining(self) -> int:
        """Prompt tokens not yet cached."""
        return len(self.context) - self.table.length

    def fail(self, error: HybridSpecError) -> None:
        """Give up: free the pages and keep the error for the caller."""
        self.table.release()
        self.phase, self.error = OpenPhase.FAILED, error


class Verifier:
    """Owns one target model, its KV pool and the sessions verified against it."""

    def __init__(self, target: LoadedModel, limits: VerifierLimits | None = None) -> None:
        self.target = target
        self.limits = limits if limits is not None else VerifierLimits()
        self.engine = Engine(target.model, self.limits.kv_cache_tokens)
        self.info = ModelInfo(
            model_name=target.name, vocab_size=target.vocab_size,
            tokenizer_fingerprint=tokenizer_fingerprint(target.tokenizer),
            model_fingerprint=model_fingerprint(target.model), max_context=self.limits.max_context,
            max_draft=self.limits.max_draft, max_sessions=self.limits.max_sessions,
            idle_timeout_s=self.limits.idle_timeout_s, eos_token_ids=target.eos_token_ids,
            device=str(target.device), dtype=str(target.model.dtype).removeprefix("torch."),
            feature_dim=target.model.config.hidden_size)
        self._sessions = SessionStore(self.limits.max_sessions, self.limits.idle_timeout_s)
        self.telemetry = Telemetry()
        self._lock = threading.Lock()  # one step or bookkeeping call at a time

    # ---- bookkeeping ---------------------------------------------------------------------------

    def stats(self) -> VerifierStats:
        """Sessions held, their cached tokens, evictions so far, and the KV pool's size."""
        with self._lock:
            self._sessions.expire_idle()
            pool = self.engine.pool
            return VerifierStats(len(self._sessions), self._sessions.cached_tokens, self._sessions.evictions,
                                 self._sessions.ids(), pool.capacity_tokens,
                                 self.telemetry.snapshot(1.0 - pool.free_pages / pool.pages))

    def close_session(self, session_id: str) -> bool:
        """Free a session's pages; True if it existed."""
        with self._lock:
            return self._sessions.pop(session_id)

    def begin_open(self, spec: SessionSpec) -> Opening:
        """Validate an open and check there is room; its prompt is then fed by `step`."""
        spec.check_against(self.info)
        if not isinstance(spec.features, FeatureFormat):
            raise InvalidArgument(f"features {spec.features!r} is not a FeatureFormat")
        with self._lock:
            self._sessions.reserve(spec.session_id)
        return Opening(spec, PageTable(self.engine.pool))

    def abandon(self, opening: Opening) -> None:
        """The caller went away: free what the open holds."""
        with self._lock:
            if opening.phase is OpenPhase.FEEDING:
                opening.fail(FailedPrecondition("the open was abandoned"))

    # ---- driving steps directly ----------------------------------------------------------------

    def open_session(self, spec: SessionSpec) -> SessionOpened:
        """Open (or re-open, replacing) a session from its committed tokens; returns its length and
        the features it asked for."""
        opening = self.begin_open(spec)
        while opening.phase is OpenPhase.FEEDING:
            self.step([], [opening])
        if opening.error is not None:
            raise opening.error
        return opening.opened()

    def verify(self, block: DraftBlock) -> VerifyResult:
        """Score one block in one forward pass over its session's cached context."""
        (result,) = self.verify_batch([block])
        if isinstance(result, HybridSpecError):
            raise result
        return result

    def verify_batch(self, blocks: Sequence[DraftBlock]) -> list[VerifyResult | HybridSpecError]:
        """Verify many sessions' rounds, scoring all valid ones in one forward pass."""
        return self.step(blocks, [])

    # ---- one step ------------------------------------------------------------------------------

    def step(self, blocks: Sequence[DraftBlock], openings: Sequence[Opening],
             prefill_tokens: int | None = None) -> list[VerifyResult | HybridSpecError]:
        """Run rounds and up to `prefill_tokens` (default and at most `prefill_chunk`) prompt tokens of
        `openings` (oldest first).

        Returns, per block and in order, its result or the error it earned; one bad block never
        fails the others. Two rounds of one session are scored one after the other. An opening's
        progress is in its phase.
        """
        results: list[VerifyResult | HybridSpecError | None] = [None] * len(blocks)
        pending = list(range(len(blocks)))
        chunk = self.limits.prefill_chunk
        budget = chunk if prefill_tokens is None else max(0, min(prefill_tokens, chunk))
        with self._lock:
            feeding = [o for o in openings if o.phase is OpenPhase.FEEDING]
            while True:
                wave, later, seen = [], [], set()
                for i in pending:
                    (later if blocks[i].session_id in seen else wave).append(i)
                    seen.add(blocks[i].session_id)
                self._run_wave([(i, blocks[i]) for i in wave], feeding, results, budget)
                feeding, pending = [], later
                if not pending:
                    break
        return results  # type: ignore[return-value]

    def _run_wave(self, items: list[tuple[int, DraftBlock]], openings: list[Opening], results: list,
                  prefill_tokens: int) -> None:
        """One forward pass for blocks of distinct sessions plus prompt chunks (lock held)."""
        # 1. Admit: identical replays are answered from memory, bad blocks get their error.
        admitted: list[tuple[int, DraftBlock, Session]] = []
        for i, block in items:
            try:
                session = self._sessions.get(block.session_id)
                if block.owner != session.spec.owner:
                    raise PermissionDenied("this session belongs to another identity")
                block.validate(self.info.vocab_size, self.limits.max_draft,
                               needs_probs=session.spec.mode.uses_draft_probs)
                if session.last_block is not None and block.round == session.next_round - 1:
                    results[i] = self._replay(block, session)
                    continue
                self._admit(block, session)
                admitted.append((i, block, session))
            except HybridSpecError as exc:
                results[i] = exc
        # 2. Pages for every feed; a feed that cannot get them fails alone.
        feeds, rounds, chunks = self._plan(admitted, openings, results, prefill_tokens)
        if not feeds:
            return
        # 3. One pass over [last committed token, x_1..x_γ] per round gives p_1..p_{γ+1}.
        start = time.perf_counter()
        try:
            scores = self.engine.forward(feeds)
        except Exception as exc:  # a bug or a failed device: no session changes
            error = incident(log, exc, "a verification forward pass")
            for i, _, session in rounds:
                self._roll_back(session)
                results[i] = error
            for opening in openings:
                if opening.phase is OpenPhase.FEEDING:
                    opening.fail(error)
            return
        forward_ms = (time.perf_counter() - start) * 1e3
        self.telemetry.iteration_tokens.observe(sum(len(feed.tokens) for feed in feeds))
        answered = time.monotonic()
        # 4. Apply each session's rule; keep the KV of committed + accepted draft (the new token is
        #    fed at the head of the next block). A failure here is the failing session's alone.
        for (i, block, session), round_scores in zip(rounds, scores):
            try:
                outcome = _apply_rule(session.spec, block, round_scores.logits, session.committed)
                # Features of the tokens now committed context: the last committed one and the accepted.
                features = _features(session.spec, round_scores.hidden, len(session.committed) - 1,
                                     outcome.num_accepted + 1)
                session.table.truncate(len(session.committed) + outcome.num_accepted)
            except Exception as exc:
                self._roll_back(session)
                results[i] = incident(log, exc, "a verification rule")
                continue
            self._observe_latency(session, outcome.num_accepted + 1, answered)
            session.committed += [*block.draft_ids[:outcome.num_accepted], outcome.token]
            session.next_round = block.round + 1
            session.last_block = block
            session.last_result = VerifyResult(
                round=block.round, num_accepted=outcome.num_accepted, next_token=outcome.token,
                committed_len=len(session.committed), verify_ms=forward_ms, batch_size=len(rounds),
                features=features)
            results[i] = session.last_result
        # 5. Openings keep their chunk's features; those whose prompt is now cached become sessions.
        for (opening, position), chunk_scores in zip(chunks, scores[len(rounds):]):
            try:
                features = _features(opening.spec, chunk_scores.hidden, position)
            except Exception as exc:
                opening.fail(incident(log, exc, "encoding features"))
                continue
            if features is not None:
                opening.features.append(features)
        for opening in openings:
            if opening.phase is OpenPhase.FEEDING and opening.remaining == 0:
                self._finish(opening)

    def _plan(self, admitted: list[tuple[int, DraftBlock, Session]], openings: list[Opening], results: list,
              prefill_tokens: int) -> tuple[list[Feed], list[tuple[int, DraftBlock, Session]], list[tuple[Opening, int]]]:
        """The step's feeds: every admitted round, then prompt chunks up to `prefill_tokens` tokens
        (with, per chunk, its opening and the position of its first token)."""
        keep = {block.session_id for _, block, _ in admitted} | {o.spec.session_id for o in openings}
        feeds, rounds, chunks = [], [], []
        for i, block, session in admitted:
            tokens = [session.committed[-1], *block.draft_ids]
            try:
                self._grow(session.table, len(tokens), keep)
            except HybridSpecError as exc:
                results[i] = exc
                continue
            feeds.append(Feed(session.table, tokens, scored=True, features=_wants_features(session.spec)))
            rounds.append((i, block, session))
        budget = prefill_tokens
        for opening in openings:
            if opening.remaining == 0:
                self._finish(opening)  # a one-token prompt has nothing to prefill
                continue
            if budget == 0:
                break
            start = opening.table.length
            chunk = list(opening.context[start:start + budget])
            try:
                self._grow(opening.table, len(chunk), keep)
            except HybridSpecError as exc:
                opening.fail(exc)
                continue
            feeds.append(Feed(opening.table, chunk, scored=False, features=_wants_features(opening.spec)))
            chunks.append((opening, start))
            budget -= len(chunk)
        return feeds, rounds, chunks

    def _observe_latency(self, session: Session, tokens: int, now: float) -> None:
        """A new generation's first answer is its time to first token; every later answer spreads the
        time since the previous one over the tokens it commits. The first answer after a re-open is
        neither (its wait was the edge's recovery)."""
        if session.answered_at:
            self.telemetry.itl.observe((now - session.answered_at) / tokens, tokens)
        elif len(session.spec.committed_ids) == session.spec.prompt_end:
            self.telemetry.ttft.observe(now - session.opened_at)
        session.answered_at = now

    def _grow(self, table: PageTable, tokens: int, keep: set[str]) -> None:
        """Room in the pool for `tokens` more tokens, evicting idle LRU sessions if it is full."""
        needed = table.pages_needed(tokens)
        if needed > self.engine.pool.free_pages:
            self._sessions.make_room(self.engine.pool, needed, keep)
        table.grow(tokens)

    def _finish(self, opening: Opening) -> None:
        """Make a fully cached opening a live session (replacing one of the same id)."""
        try:
            self._sessions.reserve(opening.spec.session_id)  # others may have taken the room meanwhile
        except HybridSpecError as exc:
            opening.fail(exc)
            return
        spec = opening.spec
        self._sessions.put(Session(spec=spec, committed=list(spec.committed_ids), table=opening.table,
                                   next_round=spec.next_round, opened_at=opening.started))
        opening.phase = OpenPhase.OPEN

    @staticmethod
    def _roll_back(session: Session) -> None:
        """Cut the cache back to the committed tokens (all but the last, which the next block feeds)."""
        session.table.truncate(min(session.table.length, len(session.committed) - 1))

    @staticmethod
    def _replay(block: DraftBlock, session: Session) -> VerifyResult:
        """The stored answer, if this is exactly the block it answered."""
        if block != session.last_block:
            raise FailedPrecondition(f"round {block.round} was already answered for a different block; "
                                     "send the next round")
        assert session.last_result is not None
        return session.last_result

    def _admit(self, block: DraftBlock, session: Session) -> None:
        """Raise the error a valid block still deserves, if any (messages name only what the request said)."""
        if block.round != session.next_round:
            raise FailedPrecondition(f"round {block.round} is not this session's next round")
        if block.committed_len != len(session.committed):
            raise FailedPrecondition(
                f"committed_len {block.committed_len} disagrees with this session's committed length")
        if len(session.committed) + len(block.draft_ids) + 1 > self.limits.max_context:
            raise ResourceExhausted(f"the block would grow the session past max_context {self.limits.max_context}")


def _wants_features(spec: SessionSpec) -> bool:
    return spec.features is not FeatureFormat.NONE


def _features(spec: SessionSpec, hidden: torch.Tensor | None, position: int,
              count: int | None = None) -> FeatureBlock | None:
    """The features of a feed's first `count` tokens (all if None), the first being the session's
    position `position`, in the format the session asked for; None if it asked for none."""
    if hidden is None:
        return None
    return encode_features(hidden[:count], position, spec.features)


def _apply_rule(spec: SessionSpec, block: DraftBlock, logits: torch.Tensor, committed: list[int]) -> rules.Outcome:
    """The session's acceptance rule on one block. logits: [γ+1, V] float32 on the model's device,
    scoring the positions after committed + draft[:j].

    Greedy needs only argmaxes, taken on the device; the sampling rules get probabilities on the CPU
    so that a seeded round draws the same numbers on CPU and GPU replicas. Penalties come first in
    every mode (docs/design.md §2.1).
    """
    if spec.mode is Mode.GREEDY:
        logits = penalize(logits, spec.sampling, committed, spec.prompt_end, block.draft_ids)
        return rules.verify_greedy(torch.tensor(block.draft_ids, dtype=torch.long, device=logits.device), logits)
    draft = torch.tensor(block.draft_ids, dtype=torch.long)
    logits = penalize(logits.cpu(), spec.sampling, committed, spec.prompt_end, block.draft_ids)
    target_probs = logits_to_probs(logits, spec.sampling)
    if spec.mode is Mode.COUPLED:
        # Row 0 scores the position after the committed tokens: noise by position, never by round.
        return rules.verify_coupled(draft, target_probs, spec.seed, len(committed))
    generator = round_generator(spec.seed, block.round)
    if spec.mode is Mode.BILD:
        return rules.verify_bild(draft, target_probs, spec.rollback_threshold,
                                 None if spec.sampling.greedy else generator)
    draft_probs = torch.zeros(len(block.draft_ids), logits.shape[-1], dtype=torch.float32)
    for i, (ids, ps) in enumerate(zip(block.support_ids, block.probs)):
        draft_probs[i, list(ids)] = torch.tensor(ps, dtype=torch.float32)
    lenience = spec.lenience if spec.mode is Mode.LENIENT else 1.0
    return rules.verify_speculative(draft, draft_probs, target_probs, generator, lenience)
