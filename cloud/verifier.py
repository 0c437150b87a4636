"""The verifier core: the target model, its per-session KV caches and the verification rules.

No gRPC and no Ray here: requests and replies are the plain dataclasses of common/wire.py, errors
are the domain errors of common/errors.py. `verify_batch` scores many sessions' rounds in one
forward pass; `verify` is the batch of one.

Integrity rules, enforced here for every caller:
- Everything a request carries is validated before any state changes.
- A round commits fully or leaves its session exactly as it was: if anything fails after the forward
  pass extended a session's cache, the cache is cut back to the committed tokens. So a cache never
  holds more than the committed tokens plus the block being scored, and one session's failure is
  never another's.
- A replayed round is answered from memory only when it is the very block that was answered.
- A prefill runs in chunks and yields the model to waiting rounds between chunks (cloud/modellock.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..common import verification as rules
from ..common.errors import FailedPrecondition, HybridSpecError, ResourceExhausted, incident
from ..common.models import LoadedModel, model_fingerprint, tokenizer_fingerprint, truncate_cache
from ..common.sampling import logits_to_probs, round_generator
from ..common.wire import DraftBlock, Mode, ModelInfo, SessionSpec, VerifyResult
from .batched_forward import batched_forward, supports_batching
from .modellock import ModelLock
from .sessions import Session, SessionStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifierLimits:
    """Per-replica limits; requests beyond them get an explicit status."""

    max_context: int = 4096  # committed + draft tokens per session
    max_draft: int = 32  # longest block accepted
    max_sessions: int = 64  # sessions held at once; more get RESOURCE_EXHAUSTED
    idle_timeout_s: int = 600  # an idle session is dropped after this
    max_cached_tokens: int = 0  # LRU sessions are evicted while all hold more tokens than this; 0 = no cap
    prefill_chunk: int = 128  # prompt tokens per prefill forward pass; waiting rounds run between chunks


@dataclass(frozen=True)
class VerifierStats:
    """Counters a replica reports to the front door's metrics."""

    sessions: int
    cached_tokens: int
    evictions: int
    session_ids: tuple[str, ...] = ()  # the sessions held right now, for the front door's routing table


class Verifier:
    """Owns one target model and the sessions verified against it."""

    def __init__(self, target: LoadedModel, limits: VerifierLimits | None = None) -> None:
        self.target = target
        self.limits = limits if limits is not None else VerifierLimits()
        self.info = ModelInfo(
            model_name=target.name, vocab_size=target.vocab_size,
            tokenizer_fingerprint=tokenizer_fingerprint(target.tokenizer),
            model_fingerprint=model_fingerprint(target.model), max_context=self.limits.max_context,
            max_draft=self.limits.max_draft, max_sessions=self.limits.max_sessions,
            idle_timeout_s=self.limits.idle_timeout_s, eos_token_ids=target.eos_token_ids)
        self.batchable = supports_batching(target.model)
        self._sessions = SessionStore(self.limits.max_sessions, self.limits.idle_timeout_s,
                                      self.limits.max_cached_tokens)
        self._lock = ModelLock()

    def stats(self) -> VerifierStats:
        """Sessions held, their cached tokens, and evictions so far."""
        with self._lock.for_prefill():
            self._sessions.expire_idle()
            return VerifierStats(len(self._sessions), self._sessions.cached_tokens, self._sessions.evictions,
                                 self._sessions.ids())

    def open_session(self, spec: SessionSpec) -> int:
        """Open (or re-open, replacing) a session from its committed tokens; returns its length.

        The prompt is fed in chunks of `prefill_chunk` tokens; rounds of other sessions run between
        them. The session becomes visible only once its cache is complete.
        """
        spec.check_against(self.info)
        with self._lock.for_prefill():
            self._sessions.reserve(spec.session_id)
        cache = DynamicCache(config=self.target.model.config)
        context = list(spec.committed_ids[:-1])
        chunk = self.limits.prefill_chunk
        for start in range(0, len(context), chunk):
            with self._lock.for_prefill():
                self._prefill(context[start:start + chunk], cache)
        with self._lock.for_prefill():
            self._sessions.reserve(spec.session_id)  # others may have taken the room meanwhile
            self._sessions.put(Session(spec=spec, committed=list(spec.committed_ids), cache=cache,
                                       next_round=spec.next_round))
        return len(spec.committed_ids)

    def close_session(self, session_id: str) -> bool:
        """Free a session's cache; True if it existed."""
        with self._lock.for_prefill():
            return self._sessions.pop(session_id)

    def verify(self, block: DraftBlock) -> VerifyResult:
        """Score one block in one forward pass over its session's cached context."""
        (result,) = self.verify_batch([block])
        if isinstance(result, HybridSpecError):
            raise result
        return result

    def verify_batch(self, blocks: Sequence[DraftBlock]) -> list[VerifyResult | HybridSpecError]:
        """Verify many sessions' rounds, scoring all valid ones in one forward pass.

        Returns, per block and in order, its result or the error it earned; one bad block never
        fails the others. Two rounds of one session are scored one after the other.
        """
        results: list[VerifyResult | HybridSpecError | None] = [None] * len(blocks)
        pending = list(range(len(blocks)))
        with self._lock.for_rounds():
            while pending:
                wave, later, seen = [], [], set()
                for i in pending:
                    (later if blocks[i].session_id in seen else wave).append(i)
                    seen.add(blocks[i].session_id)
                self._verify_wave([(i, blocks[i]) for i in wave], results)
                pending = later
        return results  # type: ignore[return-value]

    def _verify_wave(self, items: list[tuple[int, DraftBlock]], results: list) -> None:
        """One forward pass for blocks of distinct sessions (lock held)."""
        # 1. Admit: identical replays are answered from memory, bad blocks get their error.
        admitted: list[tuple[int, DraftBlock, Session]] = []
        for i, block in items:
            try:
                session = self._sessions.get(block.session_id)
                block.validate(self.info.vocab_size, self.limits.max_draft,
                               needs_probs=session.spec.mode.uses_draft_probs)
                if session.last_block is not None and block.round == session.next_round - 1:
                    results[i] = self._replay(block, session)
                    continue
                self._admit(block, session)
                admitted.append((i, block, session))
            except HybridSpecError as exc:
                results[i] = exc
        if not admitted:
            return
        # 2. One pass over [last committed token, x_1..x_γ] per session gives p_1..p_{γ+1}.
        start = time.perf_counter()
        try:
            logits = self._score(admitted)
        except Exception as exc:  # a bug or a failed device: no session changes
            error = incident(log, exc, "a verification forward pass")
            for i, _, session in admitted:
                self._roll_back(session)
                results[i] = error
            return
        forward_ms = (time.perf_counter() - start) * 1e3
        # 3. Apply each session's rule; keep the KV of committed + accepted draft (the new token is
        #    fed at the head of the next block). A failure here is the failing session's alone.
        for (i, block, session), session_logits in zip(admitted, logits):
            try:
                outcome = _apply_rule(session.spec, block, session_logits)
                truncate_cache(session.cache, len(session.committed) + outcome.num_accepted)
            except Exception as exc:
                self._roll_back(session)
                results[i] = incident(log, exc, "a verification rule")
                continue
            session.committed += [*block.draft_ids[:outcome.num_accepted], outcome.token]
            session.next_round = block.round + 1
            session.last_block = block
            session.last_result = VerifyResult(
                round=block.round, num_accepted=outcome.num_accepted, next_token=outcome.token,
                committed_len=len(session.committed), verify_ms=forward_ms, batch_size=len(admitted))
            results[i] = session.last_result
        self._sessions.enforce_budget(keep=admitted[-1][1].session_id)

    def _score(self, admitted: list[tuple[int, DraftBlock, Session]]) -> list[torch.Tensor]:
        """Logits [γ_i+1, V] per admitted block; each session's cache then also holds its block."""
        feeds = [[session.committed[-1], *block.draft_ids] for _, block, session in admitted]
        if len(admitted) > 1 and self.batchable:
            logits, caches = batched_forward(self.target.model, [s.cache for _, _, s in admitted], feeds)
            for (_, _, session), cache in zip(admitted, caches):
                session.cache = cache
            return logits
        return [self._forward(feed, session.cache) for feed, (_, _, session) in zip(feeds, admitted)]

    @staticmethod
    def _roll_back(session: Session) -> None:
        """Cut the cache back to the committed tokens (all but the last, which the next block feeds)."""
        truncate_cache(session.cache, len(session.committed) - 1)

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

    @torch.inference_mode()
    def _prefill(self, token_ids: list[int], cache: DynamicCache) -> None:
        """Feed context tokens into the cache. No logits are needed, so the output head (a fifth of
        the small target's per-token cost) runs for one position only."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.target.device)
        self.target.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def _forward(self, token_ids: list[int], cache: DynamicCache) -> torch.Tensor:
        """Feed tokens after the cached ones; returns float32 CPU logits [len(token_ids), V].

        Logits go to the CPU so verifier randomness is the same on CPU and GPU replicas.
        """
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.target.device)
        out = self.target.model(input_ids=ids, past_key_values=cache, use_cache=True)
        return out.logits[0].float().cpu()


def _apply_rule(spec: SessionSpec, block: DraftBlock, logits: torch.Tensor) -> rules.Outcome:
    """The session's acceptance rule on one block. logits: [γ+1, V] float32."""
    draft = torch.tensor(block.draft_ids, dtype=torch.long)
    if spec.mode is Mode.GREEDY:
        return rules.verify_greedy(draft, logits)
    target_probs = logits_to_probs(logits, spec.sampling)
    generator = round_generator(spec.seed, block.round)
    if spec.mode is Mode.BILD:
        return rules.verify_bild(draft, target_probs, spec.rollback_threshold,
                                 None if spec.sampling.greedy else generator)
    draft_probs = torch.zeros(len(block.draft_ids), logits.shape[-1], dtype=torch.float32)
    for i, (ids, ps) in enumerate(zip(block.support_ids, block.probs)):
        draft_probs[i, list(ids)] = torch.tensor(ps, dtype=torch.float32)
    lenience = spec.lenience if spec.mode is Mode.LENIENT else 1.0
    return rules.verify_speculative(draft, draft_probs, target_probs, generator, lenience)
