"""The verifier core: the target model, its per-session KV caches and the verification rules.

No gRPC here: requests and replies are the plain dataclasses of common/wire.py, errors are the
domain errors of common/errors.py. One lock serialises model use, which keeps each KV cache
consistent while the gRPC layer runs calls from a thread pool.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..common import verification as rules
from ..common.errors import FailedPrecondition, ResourceExhausted
from ..common.models import LoadedModel, model_fingerprint, tokenizer_fingerprint, truncate_cache
from ..common.sampling import logits_to_probs, round_generator, sample
from ..common.wire import DraftBlock, GenerateSpec, Mode, ModelInfo, SessionSpec, VerifyResult
from .sessions import Session, SessionStore


@dataclass(frozen=True)
class VerifierLimits:
    """Per-replica limits; requests beyond them get an explicit status."""

    max_context: int = 4096  # committed + draft tokens per session
    max_draft: int = 32  # longest block accepted
    max_sessions: int = 64  # sessions held at once
    idle_timeout_s: int = 600  # an idle session is dropped after this


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
        self._sessions = SessionStore(self.limits.max_sessions, self.limits.idle_timeout_s)
        self._lock = threading.Lock()

    @property
    def num_sessions(self) -> int:
        """Sessions currently held."""
        return len(self._sessions)

    def open_session(self, spec: SessionSpec) -> int:
        """Open (or re-open, replacing) a session from its committed tokens; returns its length."""
        spec.validate(self.info.vocab_size)
        self._check_fingerprints(spec.tokenizer_fingerprint, spec.model_fingerprint)
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
        """Score the block in one forward pass over the cached context and apply the session's rule."""
        start = time.perf_counter()
        with self._lock:
            session = self._sessions.get(block.session_id)
            spec = session.spec
            # 1. Replays of the last round are idempotent; anything else must be the next round.
            if session.last_result is not None and block.round == session.next_round - 1:
                return session.last_result
            if block.round != session.next_round:
                raise FailedPrecondition(f"round {block.round} does not follow round {session.next_round - 1}")
            if block.committed_len != len(session.committed):
                raise FailedPrecondition(
                    f"committed_len {block.committed_len} disagrees with the verifier's {len(session.committed)}")
            block.validate(self.info.vocab_size, self.limits.max_draft,
                           needs_probs=spec.mode.uses_draft_probs)
            gamma = len(block.draft_ids)
            if len(session.committed) + gamma + 1 > self.limits.max_context:
                raise ResourceExhausted(f"the block would grow the session past max_context {self.limits.max_context}")
            # 2. One pass over [last committed token, x_1..x_γ] gives p_1..p_{γ+1}.
            logits = self._forward([session.committed[-1], *block.draft_ids], session.cache)
            outcome = self._apply_rule(spec, block, logits)
            # 3. Keep the KV of committed + accepted draft; the new token is fed next round.
            n = len(session.committed)
            truncate_cache(session.cache, n + outcome.num_accepted)
            session.committed += [*block.draft_ids[:outcome.num_accepted], outcome.token]
            session.next_round = block.round + 1
            session.last_result = VerifyResult(
                round=block.round, num_accepted=outcome.num_accepted, next_token=outcome.token,
                committed_len=len(session.committed), verify_ms=(time.perf_counter() - start) * 1e3)
            return session.last_result

    def generate(self, spec: GenerateSpec) -> Iterator[int]:
        """Cloud-only baseline: decode autoregressively, yielding one token at a time."""
        spec.validate(self.info.vocab_size)
        self._check_fingerprints(spec.tokenizer_fingerprint, "")
        if len(spec.prompt_ids) + spec.max_new_tokens > self.limits.max_context:
            raise ResourceExhausted(f"prompt + max_new_tokens exceeds max_context {self.limits.max_context}")
        cache = DynamicCache(config=self.target.model.config)
        generator = round_generator(spec.seed, 0)
        feed = list(spec.prompt_ids)
        eos = set(self.info.eos_token_ids)
        for _ in range(spec.max_new_tokens):
            # The lock is taken per token so that verification rounds interleave with long streams.
            with self._lock:
                logits = self._forward(feed, cache)[-1]
            token = (int(logits.argmax().item()) if spec.sampling.greedy
                     else sample(logits_to_probs(logits, spec.sampling), generator))
            yield token
            if token in eos:
                return
            feed = [token]

    def _check_fingerprints(self, tokenizer_fp: str, model_fp: str) -> None:
        if tokenizer_fp and tokenizer_fp != self.info.tokenizer_fingerprint:
            raise FailedPrecondition(
                f"tokenizer fingerprint mismatch: edge has {tokenizer_fp}, verifier has {self.info.tokenizer_fingerprint}")
        if model_fp and model_fp != self.info.model_fingerprint:
            raise FailedPrecondition(
                f"model fingerprint mismatch: edge expects {model_fp}, verifier serves {self.info.model_fingerprint}")

    @torch.inference_mode()
    def _forward(self, token_ids: list[int], cache: DynamicCache) -> torch.Tensor:
        """Feed tokens after the cached ones; returns float32 CPU logits [len(token_ids), V].

        Logits go to the CPU so verifier randomness is the same on CPU and GPU replicas.
        """
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.target.device)
        out = self.target.model(input_ids=ids, past_key_values=cache, use_cache=True)
        return out.logits[0].float().cpu()

    @staticmethod
    def _apply_rule(spec: SessionSpec, block: DraftBlock, logits: torch.Tensor) -> rules.Outcome:
        draft = torch.tensor(block.draft_ids, dtype=torch.long)
        if spec.mode is Mode.GREEDY:
            return rules.verify_greedy(draft, logits)
        target_probs = logits_to_probs(logits, spec.sampling)
        generator = round_generator(spec.seed, block.round)
        if spec.mode is Mode.BILD:
            return rules.verify_bild(draft, target_probs, spec.rollback_threshold,
                                     None if spec.sampling.greedy else generator)
        vocab = logits.shape[-1]
        draft_probs = torch.zeros(len(block.draft_ids), vocab, dtype=torch.float32)
        for i, (ids, ps) in enumerate(zip(block.support_ids, block.probs)):
            draft_probs[i, list(ids)] = torch.tensor(ps, dtype=torch.float32)
        lenience = spec.lenience if spec.mode is Mode.LENIENT else 1.0
        return rules.verify_speculative(draft, draft_probs, target_probs, generator, lenience)
