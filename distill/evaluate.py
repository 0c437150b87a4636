"""How well a drafter would do as a greedy speculative drafter for its target.

In greedy mode a drafted token is accepted iff it equals the target's argmax, and while everything
so far was accepted the drafter's context is exactly the target's. So one teacher-forced pass of the
drafter over the target's own greedy continuation yields agreement flags a_t, and speculative
rounds can be replayed exactly from them: a round at position s with block length γ accepts the run
of consecutive agreements starting at s (at most γ) and then commits one more token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..common.maths.features import encode_features
from ..common.models.loading import LoadedModel
from ..common.protocol.wire import FeatureFormat, SamplingParams
from .data import Sample


@dataclass
class Report:
    """Greedy acceptance statistics over held-out samples."""

    agreement: float  # fraction of positions where drafter argmax == target token (per-token α)
    acceptance: dict[int, float]  # γ -> accepted / drafted over replayed rounds
    tokens_per_round: dict[int, float]  # γ -> committed tokens per verify round
    per_position: dict[int, list[float]]  # γ -> P(position j of a block is accepted)


@torch.inference_mode()
def agreement_flags(model: nn.Module, head_ids: torch.Tensor | None, samples: list[Sample],
                    device: torch.device) -> list[list[bool]]:
    """Per sample, per response token: does the drafter's argmax predict it?"""
    flags = []
    for s in samples:
        ids = torch.tensor([s.ids], device=device)
        logits = model(input_ids=ids).logits[0, s.start - 1: len(s.ids) - 1].float()
        pred = logits.argmax(-1)
        if head_ids is not None:
            pred = head_ids.to(device)[pred]
        flags.append((pred == ids[0, s.start:]).tolist())
    return flags


def replay(flags: list[list[bool]], gamma: int) -> tuple[int, int, int, list[int], list[int]]:
    """Replay greedy rounds of block length γ: (rounds, drafted, accepted, tries per position, hits)."""
    rounds = drafted = accepted = 0
    tries, hits = [0] * gamma, [0] * gamma
    for f in flags:
        s = 0
        while s < len(f):
            block = min(gamma, len(f) - s - 1)  # the last token always comes from the verifier
            k = 0
            while k < block and f[s + k]:
                k += 1
            for j in range(min(k + 1, block)):
                tries[j] += 1
                hits[j] += j < k
            rounds += 1
            drafted += block
            accepted += k
            s += k + 1
    return rounds, drafted, accepted, tries, hits


def evaluate(model: nn.Module, head_ids: torch.Tensor | None, samples: list[Sample], device: torch.device,
             gammas: tuple[int, ...] = (4, 8)) -> Report:
    """Agreement, acceptance, tokens per round and per-position acceptance on `samples`."""
    flags = agreement_flags(model, head_ids, samples, device)
    total = sum(len(f) for f in flags)
    report = Report(agreement=sum(map(sum, flags)) / max(total, 1), acceptance={}, tokens_per_round={},
                    per_position={})
    for gamma in gammas:
        rounds, drafted, accepted, tries, hits = replay(flags, gamma)
        report.acceptance[gamma] = accepted / max(drafted, 1)
        report.tokens_per_round[gamma] = total / max(rounds, 1)
        report.per_position[gamma] = [h / t if t else 0.0 for h, t in zip(hits, tries)]
    return report


@torch.inference_mode()
def eagle_report(loaded: LoadedModel, samples: list[Sample], feats: list[torch.Tensor], vocab_size: int,
                 fmt: FeatureFormat = FeatureFormat.INT8, gammas: tuple[int, ...] = (4, 8)) -> Report:
    """Greedy rounds replayed exactly as an edge runs them with an EAGLE head: the head sees the
    features the verifier would have sent by then (through the wire format `fmt`), bridges the rest
    with its own, and a round accepts the drafts that match the target's tokens. `agreement` is the
    acceptance of the first draft of a round (all its inputs true features)."""
    from ..edge.drafter import NgramDrafter
    from ..edge.proposal import DraftSettings, Drafting
    from ..edge.eagle import EagleDrafter, FeatureLog

    settings = DraftSettings(sampling=SamplingParams(), vocab_size=vocab_size, stop_ids=frozenset(),
                             drafting=Drafting(fallback_threshold=0.0))
    report = Report(agreement=0.0, acceptance={}, tokens_per_round={}, per_position={})
    for gamma in gammas:
        rounds = drafted = accepted = total = 0
        tries, hits = [0] * gamma, [0] * gamma
        for s, f in zip(samples, feats):
            log = FeatureLog()
            log.add(encode_features(f, 0, fmt))  # the drafter only ever reads what precedes its context
            drafter = EagleDrafter(loaded, settings, log, NgramDrafter(settings.sampling))
            pos, total = s.start, total + len(s.ids) - s.start
            while pos < len(s.ids):
                block = min(gamma, len(s.ids) - pos - 1)
                ids = drafter.propose(s.ids[:pos], block, fallback=False).ids if block else []
                k = 0
                while k < len(ids) and ids[k] == s.ids[pos + k]:
                    k += 1
                for j in range(min(k + 1, len(ids))):
                    tries[j] += 1
                    hits[j] += j < k
                rounds, drafted, accepted, pos = rounds + 1, drafted + len(ids), accepted + k, pos + k + 1
        report.acceptance[gamma] = accepted / max(drafted, 1)
        report.tokens_per_round[gamma] = total / max(rounds, 1)
        report.per_position[gamma] = [h / t if t else 0.0 for h, t in zip(hits, tries)]
        report.agreement = report.per_position[gamma][0]
    return report
