"""Verification rules for draft trees: the chain rules of verification.py, walked down a tree.

A tree is given by `parents` (common/protocol/tree.py): node i has token draft_ids[i] and parent
parents[i], ROOT (-1) for a child of the newest committed token. Siblings are listed in the order
the drafter drew them. Every rule walks from the root: at the current node it decides the target's
token there and moves to the child carrying it, or stops and emits that token. Shapes, n nodes:
    parents         n ints, a parent before its children
    draft_ids       [n] int64
    draft_probs     [n, V] float32, dense q of node i's parent position: the distribution node i was
                    drawn from (siblings carry the same row)
    target_logits   [n+1, V]
    target_probs    [n+1, V] float32
Row 0 of the target's scores is the position after the root; row i + 1 the position after node i,
that is after the committed tokens followed by the tokens of path_to(parents, i).

Every rule returns a TreeOutcome: commit the path's tokens, then `token`. For a chain
(parents = chain_parents(n)) each rule is the chain rule of the same mode, with k = len(path).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..protocol.tree import ROOT, children
from .sampling import gumbel_max, sample
from .verification import _check_shapes


@dataclass(frozen=True)
class TreeOutcome:
    """Result of verifying one tree."""

    path: tuple[int, ...]  # accepted nodes from depth 1 down, as indices into draft_ids
    token: int  # the target's token after the path: a correction, or the bonus at a leaf


def _check_tree(parents: Sequence[int], draft_ids: torch.Tensor, target: torch.Tensor) -> list[list[int]]:
    """The children lists, after checking that the shapes agree with the tree."""
    n = _check_shapes(draft_ids, target)
    assert len(parents) == n, f"parents has {len(parents)} entries for {n} draft_ids; they must match"
    return children(parents)


def _walk(kids: list[list[int]], ids: list[int], target_token: Callable[[int, int], int]) -> TreeOutcome:
    """Follow the children whose token is the target's own, `target_token(row, depth)`, from the root."""
    path: list[int] = []
    node = ROOT
    while True:
        y = target_token(node + 1, len(path))
        node = next((c for c in kids[node + 1] if ids[c] == y), None)
        if node is None:
            return TreeOutcome(tuple(path), y)
        path.append(node)


def verify_tree_greedy(parents: Sequence[int], draft_ids: torch.Tensor, target_logits: torch.Tensor) -> TreeOutcome:
    """Move to the child that is argmax of the current row while there is one; emit the argmax where
    there is none. Siblings carry distinct tokens (the wire checks it), so the path is unique: the
    longest root path that the target would have generated greedily."""
    _check_tree(parents, draft_ids, target_logits)
    # torch's tie-breaking, as verify_greedy
    return tree_greedy_from_argmax(parents, draft_ids.tolist(), target_logits.argmax(dim=-1).tolist())


def tree_greedy_from_argmax(parents: Sequence[int], draft_ids: list[int], best: list[int]) -> TreeOutcome:
    """verify_tree_greedy given the target's argmax of every row (the root's and each node's)."""
    assert len(parents) == len(draft_ids) == len(best) - 1, "parents, draft_ids and rows must match"
    return _walk(children(parents), draft_ids, lambda row, depth: best[row])


def verify_tree_speculative(parents: Sequence[int], draft_ids: torch.Tensor, draft_probs: torch.Tensor,
                            target_probs: torch.Tensor, generator: torch.Generator | None) -> TreeOutcome:
    """Recursive rejection sampling over siblings drawn without replacement (SpecTr, Sun et al.
    arXiv 2310.15141; Jeon et al., "Recursive Speculative Decoding", arXiv 2402.14160; the tree
    setting as in SpecInfer, Miao et al. arXiv 2305.09781).

    At the current node, with p its target row, the children x_1..x_m were drawn from q without
    replacement: x_j from q_j, q with x_1..x_{j-1} removed and renormalised. In order, accept x_j
    with probability min(1, p(x_j) / q_j(x_j)) and continue from that child with its own target row;
    on rejection replace p by norm(max(0, p − q_j)) and try the next sibling. When every child is
    rejected, or the node is a leaf, the token is sampled from p: the last residual, or the plain
    target row (the bonus) at a leaf reached by acceptance.

    Why it is exact (the emitted text is distributed as the target's): by induction over the
    siblings from the last one. With no sibling left the token is drawn from the current p. Step j
    is ordinary rejection sampling of p_j with proposal q_j: x_j is accepted with min(1, p_j/q_j),
    and after a rejection the token must follow norm(max(0, p_j − q_j)) = p_{j+1}; the continuation
    draws from p_{j+1} whatever x_j was, since q_{j+1} (which depends on x_j) may be any proposal for
    an exact step. So the token at each node is distributed as its p, and after an acceptance the
    same holds at the child with the target's row conditioned on the path. This needs each listed
    sibling to be a draw from its q_j, listed whatever its value: which draws a node keeps, and so
    how many siblings it gets, must not depend on their values (keeping the likeliest of more draws
    is biased; drawing with replacement and skipping repeats is not, as a new value is then a draw
    from q_j). That is the edge's obligation; nothing here can check it. For a chain this is
    verify_speculative in law, though not draw for draw: the uniforms are drawn one per sibling
    tried, not γ at once. Assumes each x_j is in q's support and siblings are distinct (the wire
    checks both), so every q_j is well defined and q_j(x_j) > 0.
    """
    kids = _check_tree(parents, draft_ids, target_probs)
    assert draft_probs.shape == target_probs[1:].shape, (
        f"draft_probs must be [n, V] = {tuple(target_probs[1:].shape)}, got {tuple(draft_probs.shape)}")
    ids = draft_ids.tolist()
    path: list[int] = []
    p = target_probs[0]
    siblings = kids[0]
    while siblings:
        remaining = draft_probs[siblings[0]].clone()  # q minus the siblings tried so far, unnormalised
        for c in siblings:
            x = ids[c]
            q_j = remaining / remaining.sum()
            # u < p/q_j  <=>  u·q_j < p, as verify_speculative; q_j(x) > 0 as x was drawn from q_j.
            if torch.rand((), generator=generator) * q_j[x] < p[x]:
                path.append(c)
                p = target_probs[c + 1]
                siblings = kids[c + 1]
                break
            residual = torch.clamp(p - q_j, min=0.0)
            total = residual.sum()
            # total <= 0 only through rounding when p ≈ q_j everywhere; p itself is then the residual.
            if total > 0:
                p = residual / total
            remaining[x] = 0.0
        else:
            break
    return TreeOutcome(tuple(path), sample(p, generator))


def verify_tree_coupled(parents: Sequence[int], draft_ids: torch.Tensor, target_probs: torch.Tensor, seed: int,
                        position: int) -> TreeOutcome:
    """Gumbel-max coupling (Daliri, Musco & Suresh, arXiv 2408.07978), walked down the tree.

    Row 0 scores absolute position `position`; the row of a node at depth d scores position + d.
    The target's token at the current node is its own coupled draw there (as in verify_coupled);
    move to the child carrying it, else emit it. The noise depends on (seed, position, token) only,
    so every committed token is one the target alone would have drawn after the same prefix: for a
    seed the output is the target's own text, whatever the tree holds, and over seeds it is
    distributed as p. Rows off the path are never drawn.
    """
    kids = _check_tree(parents, draft_ids, target_probs)

    def target_token(row: int, depth: int) -> int:
        support = torch.nonzero(target_probs[row] > 0, as_tuple=True)[0]
        return gumbel_max(support, target_probs[row, support], seed, position + depth)

    return _walk(kids, draft_ids.tolist(), target_token)
