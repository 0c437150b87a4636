"""The two Big-Little-Decoder policies (Kim et al., arXiv 2302.07863) as pure predicates."""
from __future__ import annotations

import torch


def should_fall_back(draft_probs: torch.Tensor, fallback_threshold: float) -> bool:
    """True when the drafter is not confident: its most likely token has probability < α_FB.

    draft_probs: [V], the drafter's distribution at the position about to be drafted.
    """
    return bool(draft_probs.max().item() < fallback_threshold)


def first_rollback_index(draft_ids: torch.Tensor, target_probs: torch.Tensor, rollback_threshold: float) -> int:
    """Index of the first draft token the target rejects, or len(draft_ids) if none.

    A token x_i is rolled back when its target cross-entropy −log p_i(x_i) exceeds α_RB.
    draft_ids: [γ]; target_probs: [≥γ, V].
    """
    gamma = draft_ids.shape[0]
    if gamma == 0:
        return 0
    p_x = target_probs[torch.arange(gamma), draft_ids]
    bad = (-torch.log(p_x)) > rollback_threshold
    hits = torch.nonzero(bad, as_tuple=True)[0]
    return int(hits[0].item()) if hits.numel() else gamma
