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
