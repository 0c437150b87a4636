"""The strategies that need no network: what a user would run instead of edge-cloud decoding."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import torch

from ..cloud.core.verifier import Verifier
from ..common.models.loading import LoadedModel
from ..common.protocol.wire import DraftBlock, FeatureFormat, SessionSpec, VerifyResult
from ..edge.config import EdgeConfig
from ..edge.drafters import make_drafter
from ..edge.proposal import DrafterKind
from ..edge.eagle import EagleDrafter
from ..edge.rounds import VerifyRound
from ..edge.state import GenerationState
from ..edge.stats import Stats


@dataclass
class LocalRun:
    """Tokens generated and how long it took, plus what the strategy can tell about acceptance."""

    tokens: list[int]
    wall_s: float
    stats: dict = field(default_factory=dict)


def colocated(verifier: Verifier, drafter: LoadedModel, prompt: list[int], cfg: EdgeConfig) -> LocalRun:
    """Speculative decoding with drafter and target in one process: the same drafter, rule and verify
    round as the edge (blocks of max_draft, the BiLD fallback), each block verified by a direct call."""
    stop = frozenset(verifier.info.eos_token_ids)
    draft = make_drafter(DrafterKind.MODEL, drafter, cfg.draft_settings(verifier.info.vocab_size, stop))
    log = draft.log if isinstance(draft, EagleDrafter) else None
    sid = f"colocated-{uuid.uuid4().hex}"
    state, stats = GenerationState(prompt, cfg.generation.max_new_tokens, stop), Stats()
    verify_round = VerifyRound(state, stats, draft, _DirectSession(verifier, sid),
                               with_q=cfg.resolved_mode.uses_draft_probs, features=log)
    start = time.perf_counter()
    g, features = cfg.generation, FeatureFormat(cfg.model.features) if log else FeatureFormat.NONE
    opened = verifier.open_session(SessionSpec(sid, tuple(prompt), cfg.sampling, cfg.resolved_mode, g.seed,
                                               g.rollback_threshold, g.lenience, features=features))
    if log is not None and opened.features is not None:
        log.add(opened.features)
    try:
        while not state.done:
            budget = min(cfg.policy.max_draft, cfg.generation.max_new_tokens - state.generated - 1)
            verify_round(draft.propose(state.committed, budget), budget)
    finally:
        verifier.close_session(sid)
    tokens, _ = state.result()
    return LocalRun(tokens, time.perf_counter() - start,
                    {"rounds": stats.rounds, "drafted": stats.drafted, "accepted": stats.accepted,
                     "acceptance_rate": stats.acceptance_rate,
                     "mean_tokens_per_round": len(tokens) / stats.rounds if stats.rounds else 0.0})


@dataclass(frozen=True)
class _Verified:
    """A block the verifier core already answered: nothing to wait for."""

    result: VerifyResult

    def done(self) -> bool:
        return True


@dataclass(frozen=True)
class _DirectSession:
    """A session on the verifier core in this process: each block verified by a direct call as it is
    sent; no network, nothing to recover."""

    verifier: Verifier
    id: str

    def send(self, block: DraftBlock) -> _Verified:
        return _Verified(self.verifier.verify(block))

    def verdict(self, sent: _Verified) -> VerifyResult:
        return sent.result


@torch.inference_mode()
def hf_assisted(target: LoadedModel, assistant, prompt: list[int], cfg: EdgeConfig) -> LocalRun:
    """transformers' assisted generation (`generate(assistant_model=...)`) with its own heuristics."""
    ids = torch.tensor([prompt], device=target.device)
    s = cfg.sampling
    kwargs = {"do_sample": False} if s.greedy else {
        "do_sample": True, "temperature": s.temperature, "top_k": s.top_k or None, "top_p": s.top_p}
    if not cfg.sampling.greedy:
        torch.manual_seed(cfg.generation.seed)
    start = time.perf_counter()
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=assistant,
                                max_new_tokens=cfg.generation.max_new_tokens, pad_token_id=target.eos_token_ids[0],
                                **kwargs)
    wall = time.perf_counter() - start
    return LocalRun(_until_stop(out[0, len(prompt):].tolist(), frozenset(target.eos_token_ids)), wall)


def edge_only(drafter: LoadedModel, vocab_size: int, stop_ids: tuple[int, ...], prompt: list[int],
              cfg: EdgeConfig) -> LocalRun:
    """The drafter alone, decoding with the same sampling transform."""
    draft = make_drafter(DrafterKind.MODEL, drafter, cfg.draft_settings(vocab_size, frozenset(stop_ids)))
    start = time.perf_counter()
    tokens = draft.propose(list(prompt), cfg.generation.max_new_tokens, fallback=False).ids
    return LocalRun(tokens, time.perf_counter() - start)


def _until_stop(tokens: list[int], stop: frozenset[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens


def engine_greedy(verifier: Verifier, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The served engine decoding alone, one token per pass (what `--cloud-only` streams, without the
    network): the reference every greedy row of an experiment is judged against, since a hybrid run
    is exact only against the arithmetic of the engine that verified it (docs/engine.md)."""
    session = f"reference-{uuid.uuid4().hex}"
    verifier.open_session(SessionSpec(session, tuple(prompt)))
    tokens: list[int] = []
    try:
        while len(tokens) < max_new_tokens:
            tokens.append(verifier.verify(DraftBlock(session, len(tokens), len(prompt) + len(tokens), ())).next_token)
            if tokens[-1] in verifier.info.eos_token_ids:
                break
    finally:
        verifier.close_session(session)
    return tokens
