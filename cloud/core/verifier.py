"""The verifier core: the target model, its sessions' KV pages and the verification rules.

No gRPC and no Ray here: requests and replies are the plain dataclasses of common/protocol/wire.py, errors
are the domain errors of common/protocol/errors.py. Work happens in steps (`step`): one forward pass carries
the rounds of many sessions and chunks of prompts being opened (cloud/engine/). The scheduler decides
what a pass carries (cloud/core/passes.py `plan_pass`); `step` runs exactly that pass, failing items
alone but never choosing, deferring or splitting work. `run` plans passes the same way for direct
callers. Timing a round (`VerifyResult.verify_ms`) is the scheduler's; the verifier leaves it 0.

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

import logging
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import torch

from ...common.maths.features import encode_features
from ...common.models.loading import tokenizer_fingerprint
from ...common.protocol.errors import FailedPrecondition, HybridSpecError, InvalidArgument, incident
from ...common.protocol.tree import feed_parents
from ...common.protocol.wire import (DraftBlock, FeatureBlock, FeatureFormat, Mode, ModelInfo, SessionOpened, SessionSpec,
                                     VerifyResult)
from ..engine.base import Engine, Feed, KVSequence, Scores, Target
from ..engine.torch_engine import engine_for
from .costs import measure_pass_costs
from .passes import Pass, check_pass, plan_pass, tree_nodes
from .prefixes import PrefixCache, PrefixStats, Source
from .rules import apply_rule, greedy_argmaxes
from .session import Phase, Session, SessionStore
from .limits import VerifierLimits
from .telemetry import ReplicaTelemetry, Telemetry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifierStats:
    """Counters a replica reports to the front door's metrics."""

    sessions: int
    cached_tokens: int
    evictions: int
    session_ids: tuple[str, ...] = ()  # the sessions held right now, for the front door's routing table
    kv_capacity_tokens: int = 0  # what the KV pool holds in all
    telemetry: ReplicaTelemetry | None = None  # time to first token, inter-token latency, step sizes, KV fill
    prefixes: PrefixStats = PrefixStats()  # prefix reuse since the start, closed sessions' caches kept now
    parked_tokens: int = 0  # tokens of idle sessions parked in host memory (an engine that parks)


Round = tuple[int, DraftBlock, Session]  # (index in the step's blocks, the block, its session)


class Verifier:
    """Owns one engine (the target and its KV cache) and the sessions verified against it."""

    def __init__(self, target: Target, limits: VerifierLimits | None = None, engine: Engine | None = None) -> None:
        """`engine` defaults to the torch engine over `target`'s model (a LoadedModel)."""
        self.target = target
        self.limits = limits if limits is not None else VerifierLimits()
        self.engine: Engine = engine if engine is not None else engine_for(
            target.model, self.limits.kv_cache_tokens, self.limits.max_context)
        caps = self.engine.capabilities
        if caps.max_sequence_tokens and caps.max_sequence_tokens < self.limits.max_context:
            # An engine with a fixed share of its cache per session (llama.cpp's per-session streams):
            # a session is refused past its share here, before eviction could be tried on its behalf.
            self.limits = replace(self.limits, max_context=caps.max_sequence_tokens)
        self.info = ModelInfo(
            model_name=target.name, vocab_size=target.vocab_size,
            tokenizer_fingerprint=tokenizer_fingerprint(target.tokenizer),
            model_fingerprint=target.fingerprint, max_context=self.limits.max_context,
            max_draft=self.limits.max_draft, max_sessions=self.limits.max_sessions,
            idle_timeout_s=self.limits.idle_timeout_s, eos_token_ids=target.eos_token_ids,
            device=caps.device, dtype=caps.dtype, feature_dim=caps.feature_dim,
            max_tree_nodes=tree_nodes(self.limits.max_tree_nodes, caps))
        self.prefixes = PrefixCache(self.limits.prefix_scope, self.limits.prefix_cache_tokens, self.engine.release)
        self._sessions = SessionStore(self.limits.max_sessions, self.limits.idle_timeout_s, self.engine.release,
                                      self._retire)
        self.telemetry = Telemetry()
        self._lock = threading.Lock()  # one step or bookkeeping call at a time

    def measure_pass_costs(self, max_tokens: int) -> None:
        """Time passes of 1..max_tokens tokens (at most a whole round) and report them in `info`, for the
        edges' block sizing (cloud/core/costs.py). Run it before serving: it holds the engine meanwhile."""
        with self._lock:
            largest = max(self.limits.max_draft, self.info.max_tree_nodes) + 1  # a round: the root and its drafts
            points = measure_pass_costs(self.engine, self.info.vocab_size, min(max_tokens, largest))
            self.info = replace(self.info, pass_costs=points)

    # ---- bookkeeping ---------------------------------------------------------------------------

    def stats(self) -> VerifierStats:
        """Sessions held, their cached tokens, evictions so far, and the KV cache's size."""
        with self._lock:
            self._sessions.expire_idle()
            return VerifierStats(len(self._sessions), self._sessions.cached_tokens, self._sessions.evictions,
                                 self._sessions.ids(), self.engine.capacity_tokens,
                                 self.telemetry.snapshot(self.engine.fill()), self.prefixes.stats(),
                                 getattr(self.engine, "parked_tokens", 0))

    def close_session(self, session_id: str) -> bool:
        """End a session (its cache may be kept for new sessions to start from); True if it existed."""
        with self._lock:
            return self._sessions.pop(session_id)

    def begin_open(self, spec: SessionSpec) -> Session:
        """Validate an open and check there is room; the new session (PREFILLING) is then fed by `step`."""
        spec.check_against(self.info)
        if not isinstance(spec.features, FeatureFormat):
            raise InvalidArgument(f"features {spec.features!r} is not a FeatureFormat")
        if spec.features is not FeatureFormat.NONE and not self.engine.capabilities.feature_dim:
            raise InvalidArgument(f"the {self.engine.capabilities.name} engine cannot return features")
        with self._lock:
            self._sessions.reserve(spec.session_id)
        return Session(spec, self.engine.new_sequence())

    def abandon(self, session: Session) -> None:
        """The opener went away: free what the open holds."""
        with self._lock:
            if session.phase is Phase.PREFILLING:
                session.fail(FailedPrecondition("the open was abandoned"), self.engine.release)

    # ---- driving steps directly ----------------------------------------------------------------

    def open_session(self, spec: SessionSpec) -> SessionOpened:
        """Open (or re-open, replacing) a session from its committed tokens; returns its length and
        the features it asked for."""
        session = self.begin_open(spec)
        while session.phase is Phase.PREFILLING:
            self.run([], [session])
        if session.error is not None:
            raise session.error
        return session.opened()

    def verify(self, block: DraftBlock) -> VerifyResult:
        """Score one block in one forward pass over its session's cached context."""
        (result,) = self.verify_batch([block])
        if isinstance(result, HybridSpecError):
            raise result
        return result

    def verify_batch(self, blocks: Sequence[DraftBlock]) -> list[VerifyResult | HybridSpecError]:
        """Verify many sessions' rounds, scoring all valid ones in one forward pass."""
        return self.run(blocks, [])

    def run(self, blocks: Sequence[DraftBlock], openings: Sequence[Session], prefill_tokens: int | None = None,
            busy: Collection[str] = ()) -> list[VerifyResult | HybridSpecError]:
        """Rounds and up to `prefill_tokens` (default and at most `prefill_chunk`) prompt tokens of
        `openings` (oldest first), in the passes `plan_pass` makes of them (only the first feeds
        prompts). `busy`: sessions with work queued elsewhere, never evicted to make room, like these.
        Returns, per block and in order, its result or its error; one bad block never fails the others.
        """
        chunk = self.limits.prefill_chunk
        budget = chunk if prefill_tokens is None else max(0, min(prefill_tokens, chunk))
        keep = {b.session_id for b in blocks} | {s.spec.session_id for s in openings} | set(busy)
        results: list[VerifyResult | HybridSpecError | None] = [None] * len(blocks)
        pending, feeding = list(range(len(blocks))), list(openings)
        while True:
            plan = plan_pass([blocks[i] for i in pending], feeding, lambda _: budget, self.engine.capabilities,
                             busy=keep)
            for i, result in zip(plan.taken, self.step(plan.work)):
                results[pending[i]] = result
            pending, feeding = [pending[i] for i in plan.split + plan.waiting], []
            if not pending:
                return results  # type: ignore[return-value]

    # ---- one step ------------------------------------------------------------------------------

    def step(self, work: Pass) -> list[VerifyResult | HybridSpecError]:
        """Run exactly `work` in one forward pass: its rounds (of distinct sessions) and prompt chunks of
        up to `work.streams` of its openings, `work.prefill_tokens` tokens in all. Nothing is re-selected
        or deferred: a pass beyond what the engine may carry is a planning bug (ValueError, before any
        state changes).

        Returns, per round and in order, its result or the error it earned; one bad round never fails
        the others. An opening's progress is in its phase.
        """
        check_pass(work, self.engine.capabilities)
        results: list[VerifyResult | HybridSpecError | None] = [None] * len(work.rounds)
        openings = [s for s in work.openings if s.phase is Phase.PREFILLING]
        keep = set(work.keep)
        with self._lock:
            # 1. Admit: identical replays are answered from memory, bad blocks get their error.
            rounds = self._admit(list(enumerate(work.rounds)), results)
            # 2. Room in the cache for every feed; a feed that cannot get it fails alone. A new session
            #    first starts from the longest prefix of its prompt already cached.
            feeds, rounds, chunks = self._plan(rounds, openings, results, work.prefill_tokens, work.streams, keep)
            # 3. One pass: [newest committed token, x_1..x_γ] per round gives p_1..p_{γ+1}.
            scores = self._forward(feeds, rounds, openings, results)
            if scores is not None:
                # 4. Each round's rule; its session commits the accepted drafts and the new token.
                answered = time.monotonic()
                try:
                    bests = greedy_argmaxes([session.spec for _, _, session in rounds],
                                            [s.logits for s in scores[:len(rounds)]])
                except Exception as exc:  # each rule then takes its own argmaxes, and fails alone if it must
                    log.warning("batched argmax failed (%s); rules take their own", exc)
                    bests = [None] * len(rounds)
                for (i, block, session), round_scores, best in zip(rounds, scores, bests):
                    results[i] = self._conclude(block, session, round_scores, len(rounds), answered, best)
                # 5. Prompt chunks keep the features their session asked for.
                for (session, position), chunk_scores in zip(chunks, scores[len(rounds):]):
                    self._keep_prefill_features(session, chunk_scores, position)
            # 6. Sessions whose prompt is now cached go live. Only now: a re-open replaces (and frees)
            #    the session of its id, whose cache a round of this very pass may have read.
            for session in openings:
                if session.phase is Phase.PREFILLING and session.remaining == 0:
                    self._sessions.go_live(session)
        return results  # type: ignore[return-value]

    def _admit(self, items: list[tuple[int, DraftBlock]], results: list) -> list[Round]:
        """The rounds to score; replays get their stored answer, bad blocks their error."""
        admitted = []
        for i, block in items:
            try:
                session = self._sessions.get(block.session_id)
                block.validate(self.info.vocab_size, self.limits.max_draft,
                               needs_probs=session.spec.mode.uses_draft_probs,
                               max_tree_nodes=self.info.max_tree_nodes, trees=session.spec.mode.verifies_trees)
                if session.admit(block, self.limits.max_context):
                    results[i] = session.last_result
                else:
                    admitted.append((i, block, session))
            except HybridSpecError as exc:
                results[i] = exc
        return admitted

    def _plan(self, admitted: list[Round], openings: list[Session], results: list, prefill_tokens: int,
              streams: int, keep: set[str]) -> tuple[list[Feed], list[Round], list[tuple[Session, int]]]:
        """The pass's feeds: every admitted round that gets room, then prompt chunks of up to `streams`
        openings and `prefill_tokens` tokens (with, per chunk, its session and the position of its first
        token)."""
        feeds, rounds, chunks = [], [], []
        for i, block, session in admitted:
            tokens = session.round_tokens(block)
            try:
                self._reserve(session.kv, len(tokens), keep)
            except HybridSpecError as exc:
                results[i] = exc
                continue
            feeds.append(Feed(session.kv, tokens, scored=True, features=_wants_features(session.spec),
                              parents=feed_parents(block.parents) if block.is_tree else None))
            rounds.append((i, block, session))
        budget = prefill_tokens
        for session in openings:
            if budget == 0 or streams == 0 or session.phase is not Phase.PREFILLING:
                continue
            if not session.looked_for_prefix:
                self._start_from_prefix(session, keep)
            if session.remaining == 0:  # a one-token prompt, or one cached whole by another session
                streams -= session.kv.length > 0
                continue
            start, chunk = session.kv.length, session.next_chunk(budget)
            try:
                self._reserve(session.kv, len(chunk), keep)
            except HybridSpecError as exc:
                session.fail(exc, self.engine.release)
                continue
            feeds.append(Feed(session.kv, chunk, scored=False, features=_wants_features(session.spec)))
            chunks.append((session, start))
            budget -= len(chunk)
            streams -= 1
        return feeds, rounds, chunks

    def _start_from_prefix(self, session: Session, keep: set[str]) -> None:
        """Start a new session's cache from the longest prefix of its prompt that a session of its
        scope cached (cloud/core/prefixes.py), if there is one and room for it; else nothing changes."""
        session.looked_for_prefix = True
        if _wants_features(session.spec):
            return  # its open must return the prompt's features, which only a prefill computes
        sources = (Source(s.committed, s.kv, s.spec.owner) for s in self._sessions.live())
        found = self.prefixes.find(session.committed[:-1], session.spec.owner, sources)
        if found is None:
            return
        source, length = found
        try:
            self._make_room(session.kv, length, keep, spare=source)
            self.engine.copy_prefix(source, session.kv, length)
        except HybridSpecError:
            return  # no room now: the prompt is prefilled as usual, or refused as it would have been
        self.prefixes.hit(length)

    def _forward(self, feeds: list[Feed], rounds: list[Round], openings: list[Session],
                 results: list) -> list[Scores] | None:
        """The engine's pass; on failure every fed session is left as it was and the pass's rounds and
        opens get the incident."""
        if not feeds:
            return None
        try:
            scores = self.engine.forward(feeds)
        except Exception as exc:  # a bug or a failed device: no session changes
            error = incident(log, exc, "a verification forward pass")
            for i, _, session in rounds:
                session.roll_back(self.engine.truncate)
                results[i] = error
            for session in openings:
                if session.phase is Phase.PREFILLING:
                    session.fail(error, self.engine.release)
            return None
        self.telemetry.iteration_tokens.observe(sum(len(feed.tokens) for feed in feeds))
        return scores

    def _conclude(self, block: DraftBlock, session: Session, scores: Scores, batch_size: int, answered: float,
                  best: list[int] | None = None) -> VerifyResult | HybridSpecError:
        """Apply the session's rule to its scores, keep the KV of committed + accepted drafts (the new
        token is fed at the head of the next block) and commit. A failure is this session's alone."""
        try:
            nodes, token = apply_rule(session.spec, block, scores.logits, session.committed, best)
            # Fed rows that stay: the newest committed token (row 0) and the accepted nodes. Their
            # features are the session's next committed context, and only their keys stay cached.
            rows = [0, *(node + 1 for node in nodes)]
            features = _features(session.spec, scores.hidden, len(session.committed) - 1, rows)
            if block.is_tree:
                self.engine.keep_rows(session.kv, len(session.committed) - 1, rows)
            else:
                self.engine.truncate(session.kv, len(session.committed) + len(nodes))
        except Exception as exc:
            session.roll_back(self.engine.truncate)
            return incident(log, exc, "a verification rule")
        self._observe_latency(session, len(nodes) + 1, answered)
        result = VerifyResult(round=block.round, num_accepted=len(nodes), next_token=token,
                              committed_len=len(session.committed) + len(nodes) + 1,
                              batch_size=batch_size, features=features,
                              accepted_path=tuple(nodes) if block.is_tree else ())
        session.commit(block, [block.draft_ids[node] for node in nodes], result)
        return result

    def _keep_prefill_features(self, session: Session, scores: Scores, position: int) -> None:
        try:
            features = _features(session.spec, scores.hidden, position)
        except Exception as exc:
            session.fail(incident(log, exc, "encoding features"), self.engine.release)
            return
        if features is not None:
            session.prefill_features.append(features)

    def _observe_latency(self, session: Session, tokens: int, now: float) -> None:
        """A new generation's first answer is its time to first token; every later answer spreads the
        time since the previous one over the tokens it commits. The first answer after a re-open is
        neither (its wait was the edge's recovery)."""
        if session.answered_at:
            self.telemetry.itl.observe((now - session.answered_at) / tokens, tokens)
        elif len(session.spec.committed_ids) == session.spec.prompt_end:
            self.telemetry.ttft.observe(now - session.opened_at)
        session.answered_at = now

    def _reserve(self, kv: KVSequence, tokens: int, keep: set[str]) -> None:
        """Room for `tokens` more tokens of `kv`, making it if the cache is full (`_make_room`)."""
        self._make_room(kv, tokens, keep)
        self.engine.reserve(kv, tokens)

    def _make_room(self, kv: KVSequence, tokens: int, keep: set[str], spare: KVSequence | None = None) -> None:
        """Until `tokens` more tokens of `kv` fit: drop closed sessions' kept caches, then evict idle
        sessions, least recently used first; never a session in `keep`, nor the cache `spare`."""
        fits = lambda: self.engine.fits(kv, tokens)  # noqa: E731
        while not fits() and self.prefixes.drop_oldest(spare):
            pass
        if not fits():
            self._sessions.make_room(fits, keep, spare)

    def _retire(self, session: Session) -> None:
        """A closed session's cache: kept for new sessions to start from, or released."""
        self.prefixes.keep(session.committed, session.kv, session.spec.owner)


def _wants_features(spec: SessionSpec) -> bool:
    return spec.features is not FeatureFormat.NONE


def _features(spec: SessionSpec, hidden: torch.Tensor | None, position: int,
              rows: list[int] | None = None) -> FeatureBlock | None:
    """The features of a feed's `rows` (all if None) as the session's consecutive positions from
    `position`, in the format the session asked for; None if it asked for none."""
    if hidden is None:
        return None
    if rows is not None:
        hidden = hidden[torch.tensor(rows, device=hidden.device)]
    return encode_features(hidden, position, spec.features)
