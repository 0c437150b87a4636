"""What one forward pass carries, decided once: `plan_pass` turns queued rounds and opening sessions
into a `Pass` within what the engine can do, and the verifier runs exactly that pass
(cloud/core/verifier.py `step`). Pure decisions, no engine calls: the scheduler plans its steps with
them (cloud/core/scheduler.py `schedule`), and `Verifier.run` plans passes the same way for callers
that drive the verifier directly."""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ...common.protocol.tree import leaves
from ...common.protocol.wire import DraftBlock
from ..engine.base import Capabilities
from .session import Phase, Session


@dataclass(frozen=True)
class Pass:
    """Exactly what one forward pass carries: rounds of distinct sessions, the sessions being opened
    (oldest first), how many prompt tokens in all and how many of those sessions (`streams`) get a
    chunk, and the sessions never evicted to make room for it (its own, and those with work queued)."""

    rounds: tuple[DraftBlock, ...] = ()
    openings: tuple[Session, ...] = ()
    prefill_tokens: int = 0
    streams: int = 0
    keep: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        ids = [block.session_id for block in self.rounds]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a pass carries one round per session, got {ids}")
        if self.prefill_tokens < 0 or self.streams < 0:
            raise ValueError(f"prefill_tokens and streams must be >= 0, got {self.prefill_tokens}, {self.streams}")

    @property
    def round_tokens(self) -> int:
        """Tokens the rounds feed: the newest committed token and the drafts, per round."""
        return sum(len(block.draft_ids) + 1 for block in self.rounds)


class Plan(NamedTuple):
    """A pass and where each offered block went, by its index among the blocks offered."""

    work: Pass
    taken: list[int]  # the pass's rounds, in its order
    split: list[int]  # rounds the engine's limits left for the next pass (they go first)
    waiting: list[int]  # a session's later rounds, and rounds past max_rounds, in arrival order


def plan_pass(blocks: Sequence[DraftBlock], openings: Iterable[Session], prefill: Callable[[int], int],
              caps: Capabilities, max_rounds: int | None = None, busy: Collection[str] = ()) -> Plan:
    """The next pass over `blocks` (in arrival order) and `openings` (oldest first).

    1. One round per session (a session's rounds are scored one after the other, never together),
       the first `max_rounds` of them.
    2. The prompt tokens the pass may carry beside those rounds: `prefill(round tokens)` (not asked
       when no opening is prefilling).
    3. How many openings get a chunk, within the engine's sessions per pass (`opening_sessions`).
    4. The rounds the engine can take beside them (`split_rounds`); the rest go to the next pass.
    """
    first, later, seen = [], [], set()  # (index, block) pairs; seen: every offered block's session
    for i, block in enumerate(blocks):
        (later if block.session_id in seen else first).append((i, block))
        seen.add(block.session_id)
    if max_rounds is not None:
        first, later = first[:max_rounds], first[max_rounds:] + later
    feeding = tuple(s for s in openings if s.phase is Phase.PREFILLING)
    budget = min(prefill(sum(len(block.draft_ids) + 1 for _, block in first)),
                 sum(s.remaining for s in feeding)) if feeding else 0
    limit = caps.max_sequences_per_pass or len(first) + len(feeding)
    streams = opening_sessions(feeding, budget, len(first), limit)
    now, split = split_rounds(first, caps, limit - streams)
    keep = frozenset(seen | {s.spec.session_id for s in feeding} | set(busy))
    work = Pass(tuple(block for _, block in now), feeding, max(0, budget), streams, keep)
    return Plan(work, [i for i, _ in now], [i for i, _ in split], sorted(i for i, _ in later))


def check_pass(work: Pass, caps: Capabilities) -> None:
    """Raise ValueError if `work` asks more of the engine than one pass may carry (a planning bug:
    the verifier runs a pass as given and never re-splits it)."""
    limit = caps.max_sequences_per_pass
    if limit and len(work.rounds) + min(work.streams, len(work.openings)) > limit:
        raise ValueError(f"the pass feeds more than {limit} sessions")
    _, split = split_rounds(list(enumerate(work.rounds)), caps, len(work.rounds))
    if split:
        raise ValueError(f"the pass's trees exceed the {caps.name} engine's limits")


def split_rounds(items: list[tuple[int, DraftBlock]], caps: Capabilities,
                 sessions: int) -> tuple[list[tuple[int, DraftBlock]], list[tuple[int, DraftBlock]]]:
    """(rounds for this pass, rounds for the next): at most `sessions` rounds, and trees within the
    engine's limits on leaves and on trees (a tree can always run: max_tree_nodes is capped to the leaf
    limit). Order is kept."""
    leaf_limit, tree_limit = caps.max_tree_leaves or float("inf"), caps.max_trees or float("inf")
    now, later, used, trees = [], [], 0, 0
    for item in items:
        block = item[1]
        count = leaves(block.parents) if block.is_tree else 0
        if len(now) >= sessions or (block.is_tree and now and (used + count > leaf_limit or trees + 1 > tree_limit)):
            later.append(item)
        else:
            now.append(item)
            used, trees = used + count, trees + block.is_tree
    return now, later


def opening_sessions(openings: Sequence[Session], budget: int, rounds: int, limit: int) -> int:
    """How many openings a pass with `budget` prompt tokens feeds (oldest first), when it may carry
    `limit` sessions and `rounds` rounds want to be in it: rounds come first, but a prompt to feed keeps
    at least one of the pass's sessions (so it advances even while rounds fill every pass)."""
    fed = 0
    for session in openings:
        if budget <= 0:
            break
        if session.remaining:
            fed += 1
            budget -= session.remaining
    return min(fed, max(1, limit - rounds)) if fed else 0


def tree_nodes(limit: int, caps: Capabilities) -> int:
    """The tree size a replica offers: the configured limit, none without tree masks, and never more
    leaves than one pass may carry."""
    if not caps.tree_masks:
        return 0
    return min(limit, caps.max_tree_leaves) if caps.max_tree_leaves else limit
