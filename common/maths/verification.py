"""Block verification rules: one pure function per mode (docs/design.md §2).

Glossary (the same words as protos/hybridspec/v1/verifier.proto):
    q           drafter distribution per draft position, after the sampling transform and the
                wire truncation; the draft token x_i was sampled from q_i.
    p           target distribution per position, after the same sampling transform. The target
                scores γ+1 positions in one pass: p_1..p_γ for the draft, p_{γ+1} after it.
    accepted    k, the length of the kept draft prefix.
    correction  the token emitted at the first rejected position i = k+1 (k < γ).
    bonus       the token emitted from p_{γ+1} when the whole draft is accepted (k = γ).

Every rule returns (k, token): commit draft[:k] and then token. Shapes:
    draft_ids       [γ] int64
    draft_probs     [γ, V] float32, dense q (rows sum to 1)
    target_logits   [γ+1, V]
    target_probs    [γ+1, V] float32
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..protocol.wire import DEFAULT_LENIENCE
from .bild import first_rollback_index
from .sampling import gumbel_max, sample


@dataclass(frozen=True)
class Outcome:
    """Result of verifying one block."""

    num_accepted: int  # k
    token: int  # correction (k < γ) or bonus (k == γ)


def _check_shapes(draft_ids: torch.Tensor, target: torch.Tensor) -> int:
    gamma = draft_ids.shape[0]
    assert draft_ids.dim() == 1, f"draft_ids must be [γ], got {tuple(draft_ids.shape)}"
    assert target.dim() == 2 and target.shape[0] == gamma + 1, (
        f"target scores must be [γ+1, V] = [{gamma + 1}, V], got {tuple(target.shape)}")
    return gamma


def verify_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> Outcome:
    """Accept x_i while it equals argmax p_i; emit argmax at the first mismatch (or the bonus)."""
    _check_shapes(draft_ids, target_logits)
    return greedy_from_argmax(draft_ids.tolist(), target_logits.argmax(dim=-1).tolist())


def greedy_from_argmax(draft_ids: list[int], best: list[int]) -> Outcome:
    """verify_greedy given the target's argmax of every row (γ+1 of them): for a replica that takes
    the argmaxes of many rounds in one step."""
    assert len(best) == len(draft_ids) + 1, f"need γ+1 = {len(draft_ids) + 1} argmaxes, got {len(best)}"
    for k, (x, y) in enumerate(zip(draft_ids, best)):
        if x != y:
            return Outcome(k, y)
    return Outcome(len(draft_ids), best[-1])


def verify_speculative(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                       generator: torch.Generator | None, lenience: float = DEFAULT_LENIENCE) -> Outcome:
    """Rejection sampling (Leviathan et al. 2211.17192; Chen et al. 2302.01318).

    Accept x_i with probability min(1, p_i(x_i) / (l·q_i(x_i))). At the first rejection sample the
    correction from norm(max(0, p_i − l·q_i)); if all are accepted sample the bonus from p_{γ+1}.
    With lenience l = 1 the output is distributed exactly as p. For l < 1 the residual keeps the
    same form, so the rule degrades smoothly to "accept everything the target does not rule out".
    """
    gamma = _check_shapes(draft_ids, target_probs)
    assert draft_probs.shape == (gamma, target_probs.shape[1]), (
        f"draft_probs must be [γ, V] = [{gamma}, {target_probs.shape[1]}], got {tuple(draft_probs.shape)}")
    assert 0.0 < lenience <= 1.0, f"lenience must be in (0, 1], got {lenience}"
    rows = torch.arange(gamma)
    p_x = target_probs[rows, draft_ids]
    q_x = draft_probs[rows, draft_ids]
    u = torch.rand(gamma, generator=generator)
    # u < p/(l q)  <=>  u·l·q < p; q_x > 0 because x was sampled from q.
    rejected = torch.nonzero(u * lenience * q_x >= p_x, as_tuple=True)[0]
    if rejected.numel() == 0:
        return Outcome(gamma, sample(target_probs[gamma], generator))
    k = int(rejected[0].item())
    residual = torch.clamp(target_probs[k] - lenience * draft_probs[k], min=0.0)
    if residual.sum() <= 0:
        # Only reachable through rounding when p ≈ l·q everywhere; p itself is then the residual.
        residual = target_probs[k]
    return Outcome(k, sample(residual, generator))


def verify_coupled(draft_ids: torch.Tensor, target_probs: torch.Tensor, seed: int, position: int) -> Outcome:
    """Gumbel-max coupling (Daliri, Musco & Suresh, arXiv 2408.07978): drafter-invariant sampling.

    Row i of target_probs scores absolute position `position` + i. The target's token there is
    y_i = argmax_v(log p_i(v) + G(seed, position + i, v)) (sampling.gumbel_max); accept x_i while
    x_i = y_i and emit y at the first mismatch (or y_{γ+1} after a full block). The drafter drew
    x_i = argmax_v(log q_i(v) + G(...)) with the same noise, so it agrees often; but whatever it
    drafted, every committed token is the target's y: for a seed the output is that of the target
    alone, and over seeds it is distributed exactly as p. Rows past the first mismatch are not drawn.
    """
    gamma = _check_shapes(draft_ids, target_probs)

    def target_token(i: int) -> int:
        support = torch.nonzero(target_probs[i] > 0, as_tuple=True)[0]
        return gumbel_max(support, target_probs[i, support], seed, position + i)

    for i, x in enumerate(draft_ids.tolist()):
        y = target_token(i)
        if y != x:
            return Outcome(i, y)
    return Outcome(gamma, target_token(gamma))


def verify_bild(draft_ids: torch.Tensor, target_probs: torch.Tensor, rollback_threshold: float,
                generator: torch.Generator | None) -> Outcome:
    """BiLD rollback: keep x_i until −log p_i(x_i) > α_RB; there emit the target's own token.

    The target's token is argmax p_i when `generator` is None (greedy), else a sample from p_i.
    Lossy: tokens the target merely finds plausible are kept.
    """
    _check_shapes(draft_ids, target_probs)
    k = first_rollback_index(draft_ids, target_probs, rollback_threshold)
    dist = target_probs[k]
    token = int(dist.argmax().item()) if generator is None else sample(dist, generator)
    return Outcome(k, token)
