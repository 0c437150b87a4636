"""The verifier core: the target model, its per-session KV caches and the verification rules.

No gRPC and no Ray here: requests and replies are the plain dataclasses of common/wire.py, errors
are the domain errors of common/errors.py. One lock serialises model use, which keeps each KV cache
consistent whichever thread calls in. `verify_batch` scores many sessions' rounds in one forward
pass; `verify` is the batch of one.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..common import verification as rules
from ..common.errors import FailedPrecondition, HybridSpecError, ResourceExhausted
from ..common.models import LoadedModel, model_fingerprint, tokenizer_fingerprint, truncate_cache
from ..common.sampling import logits_to_probs, round_generator
from ..common.wire import DraftBlock, Mode, ModelInfo, SessionSpec, VerifyResult
from .batched_forward import batched_forward, supports_batching
from .sessions import Session, SessionStore


@dataclass(frozen=True)
class VerifierLimits:
    """Per-replica limits; requests beyond them get an explicit status."""

    max_context: int = 4096  # committed + draft tokens per session
    max_draft: int = 32  # longest block accepted
    max_sessions: int = 64  # sessions held at once; more get RESOURCE_EXHAUSTED
    idle_timeout_s: int = 600  # an idle session is dropped after this
    max_cached_tokens: int = 0  # LRU sessions are evicted while all hold more tokens than this; 0 = no cap


@dataclass(frozen=True)
class VerifierStats:
    """Counters a replica reports to the front door's metrics."""

    sessions: int
    cached_tokens: int
    evictions: int


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
        self._lock = threading.Lock()

    def stats(self) -> VerifierStats:
        """Sessions held, their cached tokens, and evictions so far."""
        with self._lock:
            self._sessions.expire_idle()
            return VerifierStats(len(self._sessions), self._sessions.cached_tokens, self._sessions.evictions)

    def open_session(self, spec: SessionSpec) -> int:
        """Open (or re-open, replacing) a session from its committed tokens; returns its length."""
        spec.validate(self.info.vocab_size)
        self.check_fingerprints(spec.tokenizer_fingerprint, spec.model_fingerprint)
        if len(spec.committed_ids) >= self.limits.max_context:
            raise ResourceExhausted(
                f"committed_ids holds {len(spec.committed_ids)} tokens; max_context is {self.limits.max_context}")
        with self._lock:
            self._sessions.reserve(spec.session_id)
            cache = DynamicCache(config=self.target.model.config)
            if len(spec.committed_ids) > 1:
                self._forward(list(spec.committed_ids[:-1]), cache)
            self._sessions.put(Session(spec=spec, committed=list(spec.committed_ids), cache=cache,
                                       next_round=spec.next_round))
        return len(spec.committed_ids)

    def close_session(self, session_id: str) -> bool:
        """Free a session's cache; True if it existed."""
        with self._lock:
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
        with self._lock:
            while pending:
                wave, later, seen = [], [], set()
                for i in pending:
                    (later if blocks[i].session_id in seen else wave).append(i)
                    seen.add(blocks[i].session_id)
                self._verify_wave([(i, blocks[i]) for i in wave], results)
                pending = later
        return results  # type: ignore[return-value]

    def check_fingerprints(self, tokenizer_fp: str, model_fp: str) -> None:
        """FailedPrecondition when the edge expects another tokenizer or model."""
        if tokenizer_fp and tokenizer_fp != self.info.tokenizer_fingerprint:
            raise FailedPrecondition(
                f"tokenizer fingerprint mismatch: edge has {tokenizer_fp}, verifier has {self.info.tokenizer_fingerprint}")
        if model_fp and model_fp != self.info.model_fingerprint:
            raise FailedPrecondition(
                f"model fingerprint mismatch: edge expects {model_fp}, verifier serves {self.info.model_fingerprint}")

    def _verify_wave(self, items: list[tuple[int, DraftBlock]], results: list) -> None:
        """One forward pass for blocks of distinct sessions (lock held)."""
        start = time.perf_counter()
        # 1. Admit: replays are answered from memory, bad blocks get their error, the rest go on.
        admitted: list[tuple[int, DraftBlock, Session]] = []
        for i, block in items:
            try:
                session = self._sessions.get(block.session_id)
                if session.last_result is not None and block.round == session.next_round - 1:
                    results[i] = session.last_result  # an idempotent replay
                    continue
                self._admit(block, session)
                admitted.append((i, block, session))
            except HybridSpecError as exc:
                results[i] = exc
        if not admitted:
            return
        # 2. One pass over [last committed token, x_1..x_γ] per session gives p_1..p_{γ+1}.
        feeds = [[session.committed[-1], *block.draft_ids] for _, block, session in admitted]
        if len(admitted) > 1 and self.batchable:
            logits, caches = batched_forward(self.target.model, [s.cache for _, _, s in admitted], feeds)
            for (_, _, session), cache in zip(admitted, caches):
                session.cache = cache
        else:
            logits = [self._forward(feed, session.cache) for feed, (_, _, session) in zip(feeds, admitted)]
        elapsed_ms = (time.perf_counter() - start) * 1e3
        # 3. Apply each session's rule; keep the KV of committed + accepted draft (the new token
        #    is fed at the head of the next block).
        for (i, block, session), session_logits in zip(admitted, logits):
            outcome = _apply_rule(session.spec, block, session_logits)
            truncate_cache(session.cache, len(session.committed) + outcome.num_accepted)
            session.committed += [*block.draft_ids[:outcome.num_accepted], outcome.token]
            session.next_round = block.round + 1
            session.last_result = VerifyResult(
                round=block.round, num_accepted=outcome.num_accepted, next_token=outcome.token,
                committed_len=len(session.committed), verify_ms=elapsed_ms, batch_size=len(admitted))
            results[i] = session.last_result
        self._sessions.enforce_budget(keep=admitted[-1][1].session_id)

    def _admit(self, block: DraftBlock, session: Session) -> None:
        """Raise the error a block deserves, if any."""
        if block.round != session.next_round:
            raise FailedPrecondition(f"round {block.round} does not follow round {session.next_round - 1}")
        if block.committed_len != len(session.committed):
            raise FailedPrecondition(
                f"committed_len {block.committed_len} disagrees with the verifier's {len(session.committed)}")
        block.validate(self.info.vocab_size, self.limits.max_draft, needs_probs=session.spec.mode.uses_draft_probs)
        if len(session.committed) + len(block.draft_ids) + 1 > self.limits.max_context:
            raise ResourceExhausted(f"the block would grow the session past max_context {self.limits.max_context}")

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
