"""A session's acceptance rule applied to the scores of its round: which drafted nodes are kept and
the verifier's own token. The rules themselves are pure functions (common/maths/verification.py for
chains, common/maths/tree_verification.py for trees); this module turns a round's logits into what
they read — penalties, the sampling transform, the dense q, the round's generator — and picks the
rule by the session's mode and the block's shape.
"""
from __future__ import annotations

import torch

from ...common.maths import tree_verification as tree_rules
from ...common.maths import verification as rules
from ...common.maths.sampling import logits_to_probs, penalize, round_generator
from ...common.protocol.tree import path_to
from ...common.protocol.wire import DraftBlock, Mode, SessionSpec


def greedy_argmaxes(specs: list[SessionSpec], logits: list[torch.Tensor]) -> list[list[int] | None]:
    """Each round's row argmaxes where its rule needs nothing else (greedy, no penalty), else None,
    taken on the device and brought to the host together: one wait for a whole step, not one per
    round."""
    plain = [spec.mode is Mode.GREEDY and not spec.sampling.penalized for spec in specs]
    rows_used = [rows for rows, use in zip(logits, plain) if use]
    if all(rows.device.type == "cpu" and rows.dtype == torch.float32 for rows in rows_used):
        # On the CPU numpy's argmax costs a tenth of torch's (6 against 77 us for a 49,152-token row),
        # and a cloud-only token pays it once.
        flat = [int(i) for rows in rows_used for i in rows.numpy().argmax(axis=-1)]
    else:
        flat = torch.cat([rows.argmax(dim=-1) for rows in rows_used]).tolist()
    out: list[list[int] | None] = []
    for rows, use in zip(logits, plain):
        out.append(flat[:rows.shape[0]] if use else None)
        flat = flat[rows.shape[0]:] if use else flat
    return out


def apply_rule(spec: SessionSpec, block: DraftBlock, logits: torch.Tensor,
               committed: list[int], best: list[int] | None = None) -> tuple[list[int], int]:
    """The session's acceptance rule on one block: (accepted nodes, the verifier's token). logits:
    [nodes + 1, V] float32 on the model's device; row 0 scores the position after the committed
    tokens, row i + 1 the position after node i (for a chain: after committed + draft[:i + 1]).

    Greedy needs only argmaxes, taken on the device; the sampling rules get probabilities on the CPU
    so that a seeded round draws the same numbers on CPU and GPU replicas. Penalties come first in
    every mode (docs/design.md §2.1). `best`: the rows' argmaxes from greedy_argmaxes, where it gave them.
    """
    if best is not None:
        if block.is_tree:
            outcome = tree_rules.tree_greedy_from_argmax(block.parents, list(block.draft_ids), best)
            return list(outcome.path), outcome.token
        outcome = rules.greedy_from_argmax(list(block.draft_ids), best)
        return list(range(outcome.num_accepted)), outcome.token
    if block.is_tree:
        outcome = _apply_tree_rule(spec, block, logits, committed)
        return list(outcome.path), outcome.token
    outcome = _apply_chain_rule(spec, block, logits, committed)
    return list(range(outcome.num_accepted)), outcome.token


def _apply_chain_rule(spec: SessionSpec, block: DraftBlock, logits: torch.Tensor, committed: list[int]) -> rules.Outcome:
    if spec.mode is Mode.GREEDY:
        logits = penalize(logits, spec.sampling, committed, spec.prompt_end, block.draft_ids)
        return rules.verify_greedy(torch.tensor(block.draft_ids, dtype=torch.long, device=logits.device), logits)
    draft = torch.tensor(block.draft_ids, dtype=torch.long)
    logits = penalize(logits.cpu(), spec.sampling, committed, spec.prompt_end, block.draft_ids)
    target_probs = logits_to_probs(logits, spec.sampling)
    if spec.mode is Mode.COUPLED:
        # Row 0 scores the position after the committed tokens: noise by position, never by round.
        return rules.verify_coupled(draft, target_probs, spec.seed, len(committed))
    generator = round_generator(spec.seed, block.round)
    if spec.mode is Mode.BILD:
        return rules.verify_bild(draft, target_probs, spec.rollback_threshold,
                                 None if spec.sampling.greedy else generator)
    lenience = spec.lenience if spec.mode is Mode.LENIENT else 1.0
    return rules.verify_speculative(draft, _dense_q(block, logits.shape[-1]), target_probs, generator, lenience)


def _apply_tree_rule(spec: SessionSpec, block: DraftBlock, logits: torch.Tensor,
                     committed: list[int]) -> tree_rules.TreeOutcome:
    """The tree form of the session's rule (greedy, speculative or coupled: validation refused the rest)."""
    parents = block.parents
    if spec.sampling.penalized:
        # Each row's history is the committed tokens and its own root path.
        paths = [[]] + [[block.draft_ids[n] for n in path_to(parents, i)] for i in range(len(parents))]
        logits = torch.cat([penalize(logits[r:r + 1], spec.sampling, committed + path, spec.prompt_end)
                            for r, path in enumerate(paths)])
    draft = torch.tensor(block.draft_ids, dtype=torch.long, device=logits.device)
    if spec.mode is Mode.GREEDY:
        return tree_rules.verify_tree_greedy(parents, draft, logits)
    target_probs = logits_to_probs(logits.cpu(), spec.sampling)
    if spec.mode is Mode.COUPLED:
        return tree_rules.verify_tree_coupled(parents, draft.cpu(), target_probs, spec.seed, len(committed))
    return tree_rules.verify_tree_speculative(parents, draft.cpu(), _dense_q(block, logits.shape[-1]), target_probs,
                                              round_generator(spec.seed, block.round))


def _dense_q(block: DraftBlock, vocab: int) -> torch.Tensor:
    """The block's sparse q per node as dense float32 rows [nodes, V]."""
    draft_probs = torch.zeros(len(block.draft_ids), vocab, dtype=torch.float32)
    for i, (ids, ps) in enumerate(zip(block.support_ids, block.probs)):
        draft_probs[i, list(ids)] = torch.tensor(ps, dtype=torch.float32)
    return draft_probs
