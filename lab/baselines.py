"""The strategies that need no network: what a user would run instead of edge-cloud decoding."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import torch

from ..cloud.verifier import Verifier
from ..common.models import LoadedModel
from ..common.sampling import round_generator
from ..common.wire import SessionSpec
from ..edge.config import EdgeConfig
from ..edge.drafter import ModelDrafter


@dataclass
class LocalRun:
    """Tokens generated and how long it took, plus what the strategy can tell about acceptance."""

    tokens: list[int]
    wall_s: float
    stats: dict = field(default_factory=dict)


def colocated(verifier: Verifier, drafter: LoadedModel, prompt: list[int], cfg: EdgeConfig) -> LocalRun:
    """Speculative decoding with drafter and target in one process: the same drafter and rule as the
    edge (blocks of max_draft, the BiLD fallback), each block verified by a direct call."""
    stop = frozenset(verifier.info.eos_token_ids)
    draft = ModelDrafter(drafter, cfg.sampling, verifier.info.vocab_size, cfg.wire_top_k,
                         None if cfg.sampling.greedy else round_generator(cfg.seed, -1), cfg.keep_low_confidence)
    sid = f"colocated-{uuid.uuid4().hex}"
    start = time.perf_counter()
    verifier.open_session(SessionSpec(sid, tuple(prompt), cfg.sampling, cfg.resolved_mode, cfg.seed,
                                      cfg.rollback_threshold, cfg.lenience))
    committed, rounds, drafted, accepted = list(prompt), 0, 0, 0
    try:
        while len(committed) - len(prompt) < cfg.max_new_tokens:
            budget = min(cfg.max_draft, cfg.max_new_tokens - (len(committed) - len(prompt)) - 1)
            proposal = draft.propose(committed, budget, cfg.fallback_threshold, stop)
            result = verifier.verify(proposal.block(sid, rounds, len(committed), cfg.resolved_mode.uses_draft_probs))
            new = [*proposal.ids[:result.num_accepted], result.next_token]
            rounds, drafted, accepted = rounds + 1, drafted + len(proposal.ids), accepted + result.num_accepted
            committed += new
            if any(t in stop for t in new):
                break
    finally:
        verifier.close_session(sid)
    tokens = _until_stop(committed[len(prompt):], stop)[: cfg.max_new_tokens]
    return LocalRun(tokens, time.perf_counter() - start,
                    {"rounds": rounds, "drafted": drafted, "accepted": accepted,
                     "acceptance_rate": accepted / drafted if drafted else 0.0,
                     "mean_tokens_per_round": len(tokens) / rounds if rounds else 0.0})


@torch.inference_mode()
def hf_assisted(target: LoadedModel, assistant, prompt: list[int], cfg: EdgeConfig) -> LocalRun:
    """transformers' assisted generation (`generate(assistant_model=...)`) with its own heuristics."""
    ids = torch.tensor([prompt], device=target.device)
    kwargs = {"do_sample": False} if cfg.sampling.greedy else {
        "do_sample": True, "temperature": cfg.temperature, "top_k": cfg.top_k or None, "top_p": cfg.top_p}
    if not cfg.sampling.greedy:
        torch.manual_seed(cfg.seed)
    start = time.perf_counter()
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=assistant,
                                max_new_tokens=cfg.max_new_tokens, pad_token_id=target.eos_token_ids[0], **kwargs)
    wall = time.perf_counter() - start
    return LocalRun(_until_stop(out[0, len(prompt):].tolist(), frozenset(target.eos_token_ids)), wall)


def edge_only(drafter: LoadedModel, vocab_size: int, stop_ids: tuple[int, ...], prompt: list[int],
              cfg: EdgeConfig) -> LocalRun:
    """The drafter alone, decoding with the same sampling transform."""
    stop = frozenset(stop_ids)
    draft = ModelDrafter(drafter, cfg.sampling, vocab_size, cfg.wire_top_k,
                         None if cfg.sampling.greedy else round_generator(cfg.seed, -1))
    start = time.perf_counter()
    tokens = draft.propose(list(prompt), cfg.max_new_tokens, 0.0, stop).ids
    return LocalRun(tokens, time.perf_counter() - start)


def _until_stop(tokens: list[int], stop: frozenset[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens
