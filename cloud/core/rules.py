"""A session's acceptance rule applied to the scores of its round: which drafted nodes are kept and
the verifier's own token. The rules themselves are pure functions (common/maths/verification.py for
chains, common/maths/tree_verification.py for trees); this module turns a round's logits into what
they read — penalties, the sampling transform, the dense q, the round's generator — and picks the
rule by the session's mode and the block's shape.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ...common.maths import tree_verification as tree_rules
from ...common.maths import verification as rules
from ...common.maths.sampling import SamplingParams, logits_to_probs, penalize, round_generator
from ...common.protocol.tree import path_to
from ...common.protocol.wire import DraftBlock, Mode, SessionSpec

log = logging.getLogger(__name__)


class Prepared(NamedTuple):
    """What one round's rule reads from its logits, computed with the rest of its pass (`prepare_pass`);
    empty: the rule computes it from the logits itself. (A tuple: one is made for every round of a pass.)"""

    best: list[int] | None = None  # each row's argmax (greedy, no penalty)
    probs: torch.Tensor | None = None  # each row's target probabilities on the CPU (sampling, no penalty)


Decision = tuple[list[int], int]  # a round's accepted nodes and the verifier's token (`apply_rule`)


PassRows = tuple[torch.Tensor, Sequence[slice]]  # the pass's logits, and where each round's rows lie in them


def decide_pass(specs: Sequence[SessionSpec], blocks: Sequence[DraftBlock], logits: Sequence[torch.Tensor],
                committed: Sequence[list[int]], rows: PassRows | None = None) -> list[Decision | Exception]:
    """Every round of a pass decided: what `apply_rule` decides for each round alone, from what the rules
    read taken for the whole pass at once (`prepare_pass`). A rule that raises is its own round's
    exception, and a failed preparation leaves each rule its own logits."""
    try:
        prepared = prepare_pass(specs, logits, rows)
    except Exception as exc:  # noqa: BLE001 — each rule then reads its own logits, and fails alone if it must
        log.warning("preparing the pass's rules failed (%s); each rule reads its own logits", exc)
        prepared = [Prepared()] * len(specs)
    out: list[Decision | Exception] = []
    for spec, block, round_logits, history, ready in zip(specs, blocks, logits, committed, prepared):
        try:
            out.append(apply_rule(spec, block, round_logits, history, ready))
        except Exception as exc:  # noqa: BLE001 — this round's incident; the pass's other rounds are decided
            out.append(exc)
    return out


def prepare_pass(specs: Sequence[SessionSpec], logits: Sequence[torch.Tensor],
                 rows: PassRows | None = None) -> list[Prepared]:
    """What every round of a pass reads, for all of them at once, with one wait for the device: the
    greedy rounds' row argmaxes (one argmax over the pass's rows where the engine says where the rounds'
    rows lie in them, `rows`, else `row_argmaxes`: on a device one argmax over all their rows), and the
    sampling rounds' target probabilities, their rows brought to the host in one copy and transformed
    together per sampling setting. The transform reads each row alone, so a row's probabilities are the
    very bits its round would compute by itself (tests/test_batched_rules.py). Penalized rounds are left
    to their rule: each row's history, and so its penalty, is its own."""
    out = [Prepared()] * len(specs)
    greedy, sampled = [], []
    for i, spec in enumerate(specs):
        if not spec.sampling.penalized:
            (greedy if spec.mode is Mode.GREEDY else sampled).append(i)
    if greedy and rows is not None:  # the span of the pass's rows that holds the greedy rounds' (rounds come first)
        whole, where = rows
        low = min(where[i].start for i in greedy)
        flat = _argmax(whole[low:max(where[i].stop for i in greedy)])
        bests = [flat[where[i].start - low:where[i].stop - low] for i in greedy]
    else:
        bests = row_argmaxes([logits[i] for i in greedy])
    for i, best in zip(greedy, bests):
        out[i] = Prepared(best=best)
    if sampled:
        counts = [logits[i].shape[0] for i in sampled]
        on_host = dict(zip(sampled, _rows(joined([logits[i] for i in sampled]).cpu(), counts)))
        groups: dict[SamplingParams, list[int]] = {}
        for i in sampled:
            groups.setdefault(specs[i].sampling, []).append(i)
        for params, members in groups.items():
            parts = [on_host[i] for i in members]
            probs = logits_to_probs(joined(parts), params)
            for i, rows in zip(members, _rows(probs, [len(part) for part in parts])):
                out[i] = Prepared(probs=rows)
    return out


def row_argmaxes(parts: Sequence[torch.Tensor]) -> list[list[int]]:
    """Each part's row argmaxes, brought to the host together. On a device, parts that lie one after
    another in one buffer (a torch engine's pass) take one argmax over all their rows and one copy,
    else one argmax per part and one copy. On the CPU numpy's (6 against torch's 77 us for a 49,152-token
    row, and no copy of the rows), which breaks ties as torch does, by the first maximum: over all rows at
    once where they lie one after another too."""
    if not parts:
        return []
    whole = _adjacent(parts)
    if whole is not None:
        flat = _argmax(whole)
    elif all(part.is_cpu and part.dtype == torch.float32 for part in parts):
        return [part.numpy().argmax(axis=-1).tolist() for part in parts]
    else:
        flat = torch.cat([part.argmax(dim=-1) for part in parts]).tolist()
    return [flat[start:start + n] for start, n in _starts([part.shape[0] for part in parts])]


def _argmax(rows: torch.Tensor) -> list[int]:
    """Each row's argmax, on the host: numpy's on the CPU (see row_argmaxes), one argmax and one copy on a device."""
    if rows.is_cpu and rows.dtype == torch.float32:
        return rows.numpy().argmax(axis=-1).tolist()
    return rows.argmax(dim=-1).tolist()


def joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parts' rows as one tensor: a view where they lie one after another in one buffer, else a copy."""
    whole = _adjacent(parts)
    return whole if whole is not None else torch.cat(list(parts))


def _adjacent(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One view of every part's rows if they are contiguous slices of one tensor, each starting where
    the one before ends (how a pass's logits are cut per feed), else None."""
    first = parts[0]
    base, at = first._base, first.data_ptr()
    for part in parts:
        if part._base is not base or base is None or part.data_ptr() != at or not part.is_contiguous():
            return None
        at += part.numel() * part.element_size()
    rows, width = sum(part.shape[0] for part in parts), first.shape[1]
    return torch.as_strided(base, (rows, width), (width, 1), first.storage_offset())


def _starts(counts: Sequence[int]) -> list[tuple[int, int]]:
    starts, at = [], 0
    for n in counts:
        starts.append((at, n))
        at += n
    return starts


def _rows(whole: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    """`whole` cut back into parts of `counts` rows (views)."""
    return [whole[start:start + n] for start, n in _starts(counts)]


def apply_rule(spec: SessionSpec, block: DraftBlock, logits: torch.Tensor, committed: list[int],
               prepared: Prepared = Prepared()) -> Decision:
    """The session's acceptance rule on one block: (accepted nodes, the verifier's token). logits:
    [nodes + 1, V] float32 on the model's device; row 0 scores the position after the committed
    tokens, row i + 1 the position after node i (for a chain: after committed + draft[:i + 1]).

    Greedy needs only argmaxes, taken on the device; the sampling rules get probabilities on the CPU
    so that a seeded round draws the same numbers on CPU and GPU replicas. Penalties come first in
    every mode (docs/design.md §2.1). `prepared`: what prepare_pass computed for the round with the
    rest of its pass (argmaxes or probabilities), where it did.
    """
    if prepared.best is not None:
        if block.is_tree:
            outcome = tree_rules.tree_greedy_from_argmax(block.parents, list(block.draft_ids), prepared.best)
            return list(outcome.path), outcome.token
        outcome = rules.greedy_from_argmax(list(block.draft_ids), prepared.best)
        return list(range(outcome.num_accepted)), outcome.token
    if block.is_tree:
        outcome = _apply_tree_rule(spec, block, logits, committed, prepared.probs)
        return list(outcome.path), outcome.token
    outcome = _apply_chain_rule(spec, block, logits, committed, prepared.probs)
    return list(range(outcome.num_accepted)), outcome.token


def _apply_chain_rule(spec: SessionSpec, block: DraftBlock, logits: torch.Tensor, committed: list[int],
                      target_probs: torch.Tensor | None) -> rules.Outcome:
    if spec.mode is Mode.GREEDY:
        logits = penalize(logits, spec.sampling, committed, spec.prompt_end, block.draft_ids)
        return rules.verify_greedy(torch.tensor(block.draft_ids, dtype=torch.long, device=logits.device), logits)
    draft = torch.tensor(block.draft_ids, dtype=torch.long)
    if target_probs is None:
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


def _apply_tree_rule(spec: SessionSpec, block: DraftBlock, logits: torch.Tensor, committed: list[int],
                     target_probs: torch.Tensor | None) -> tree_rules.TreeOutcome:
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
    if target_probs is None:
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
