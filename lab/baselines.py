"""The strategies that need no network: what a user would run instead of edge-cloud decoding."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import torch

from ..cloud.core.verifier import Verifier
from ..common.models.loading import LoadedModel
from ..common.protocol.wire import DraftBlock, FeatureFormat, SessionSpec
from ..edge.config import EdgeConfig
from ..edge.drafters import make_drafter
from ..edge.proposal import DrafterKind
from ..edge.eagle import EagleDrafter
from ..edge.stats import Stats


@dataclass
class LocalRun:
    """Tokens generated and how long it took, plus what the strategy can tell about acceptance."""

    tokens: list[int]
    wall_s: float
    stats: dict = field(default_factory=dict)


def colocated(verifier: Verifier, drafter: LoadedModel, prompt: list[int], cfg: EdgeConfig) -> LocalRun:
    """Speculative decoding with drafter and target in one process: the edge's drafter, rule and blocks
    (max_draft, the BiLD fallback; a block and its verdict checked as the edge's generation does:
    `Proposal.block`, `Proposal.accepted`), each block verified by a direct call of the verifier core.
    Nothing is in flight while the drafter could draft, and no session is lost: no pipelining, no
    recovery."""
    stop = frozenset(verifier.info.eos_token_ids)
    draft = make_drafter(DrafterKind.MODEL, drafter, cfg.draft_settings(verifier.info.vocab_size, stop))
    log = draft.log if isinstance(draft, EagleDrafter) else None
    sid = f"colocated-{uuid.uuid4().hex}"
    with_q, max_new = cfg.resolved_mode.uses_draft_probs, cfg.generation.max_new_tokens
    committed, stats, eos = list(prompt), Stats(), False
    start = time.perf_counter()
    g, features = cfg.generation, FeatureFormat(cfg.model.features) if log else FeatureFormat.NONE
    opened = verifier.open_session(SessionSpec(sid, tuple(prompt), cfg.sampling, cfg.resolved_mode, g.seed,
                                               g.rollback_threshold, g.lenience, features=features))
    if log is not None and opened.features is not None:
        log.add(opened.features)
    try:
        while not eos and len(committed) - len(prompt) < max_new:
            budget = min(cfg.policy.max_draft, max_new - (len(committed) - len(prompt)) - 1)
            proposal = draft.propose(committed, budget)
            result = verifier.verify(proposal.block(sid, stats.rounds, len(committed), with_q))
            accepted = [proposal.ids[n] for n in proposal.accepted(result)]
            new = [*accepted, result.next_token]
            stop_at = next((i for i, token in enumerate(new) if token in stop), None)
            if stop_at is not None:  # the generation ends with its end-of-sequence token
                new, eos = new[:stop_at + 1], True
            committed += new
            stats.observe_round(len(proposal.ids), len(accepted), budget, proposal.fell_back)
            if result.features is not None and log is not None:
                log.add(result.features)
            draft.observe(accepted, result.next_token)
    finally:
        verifier.close_session(sid)
    tokens = committed[len(prompt):]
    return LocalRun(tokens, time.perf_counter() - start,
                    {"rounds": stats.rounds, "drafted": stats.drafted, "accepted": stats.accepted,
                     "acceptance_rate": stats.acceptance_rate,
                     "mean_tokens_per_round": len(tokens) / stats.rounds if stats.rounds else 0.0})


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
