"""What every drafter training loop shares: batch picking, the learning-rate schedule, one step."""
from __future__ import annotations

import math
import random

import torch

from .data import Sample


def pick(samples: list[Sample], budget: int, rng: random.Random) -> list[int]:
    """Random sample indices until their tokens reach `budget`."""
    chosen, used = [], 0
    while used < budget:
        i = rng.randrange(len(samples))
        chosen.append(i)
        used += len(samples[i].ids)
    return chosen


def warmup_cosine(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over the first 5 % of `steps`, then cosine decay to zero."""
    warmup = max(1, steps // 20)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / steps))))


def step(opt: torch.optim.Optimizer, sched, params: list[torch.Tensor], loss: torch.Tensor) -> None:
    """Backward, clip the gradient norm to 1, update, advance the schedule."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
