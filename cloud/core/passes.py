"""What one forward pass of a replica carries, decided by pure functions: no engine call, no clock, no
lock. The replica's step (cloud/core/verifier.py `Verifier.step`, its step 2) hands `plan_pass` what
is queued and what the engine can do and runs exactly the `Pass` it gets back; a policy that changes
what a pass carries (fair shares by identity, holding rounds for company) changes these functions.

Every pass carries the queued rounds (one per session, at most `max_rounds` sessions, as many as one
pass of the engine may carry: the rest go first in the next pass, without waiting for company) plus
a chunk of the prompts being opened, oldest first. Rounds come first because an edge is waiting on
each one; a prompt keeps at least one of the pass's sessions, so it advances even while rounds fill
every pass. Verify blocks and cloud-only decode steps (a block with no draft) are the same kind of work.

How long a prompt chunk is (`prefill_tokens`) depends on who is waiting. With nobody else active, a
prompt is fed `prefill_chunk` tokens a pass, the most efficient size. While other sessions are
sending rounds, a pass that carries their rounds carries no prompt, unless the pass before carried
none (so the prompt still advances at least every other pass), and a pass of prompt alone is sized
by time: its chunk fills `prefill_budget_ms` at the cost per token measured on earlier prompt passes
(`StepCost`). A round then waits behind at most about one budget, however long the prompt and
however slow the machine. The price is the prompt's: it advances in the gaps between rounds.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ...common.protocol.tree import leaves
from ...common.protocol.wire import DraftBlock
from ..engine.base import Capabilities
from .session import Phase, Session

MIN_PREFILL_CHUNK = 4  # a prompt pass always carries this much, however tight the budget
COST_SMOOTHING = 0.3  # weight of the newest pass in the running cost per token


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
              caps: Capabilities, max_rounds: int) -> Plan:
    """The next pass over `blocks` (in arrival order) and `openings` (oldest first).

    1. One round per session (a session's rounds are scored one after the other, never together),
       the first `max_rounds` of them.
    2. The prompt tokens the pass may carry beside those rounds: `prefill(round tokens)` (not asked
       when no opening is prefilling).
    3. How many openings get a chunk, within the engine's sessions per pass (`opening_sessions`).
    4. The rounds the engine can take beside them (`split_rounds`); the rest go to the next pass.
    Every session offered a round or being opened is kept from eviction while the pass makes room.
    """
    first, later, seen = [], [], set()  # (index, block) pairs; seen: every offered block's session
    for i, block in enumerate(blocks):
        (later if block.session_id in seen else first).append((i, block))
        seen.add(block.session_id)
    first, later = first[:max_rounds], first[max_rounds:] + later
    feeding = tuple(s for s in openings if s.phase is Phase.PREFILLING)
    budget = min(prefill(sum(len(block.draft_ids) + 1 for _, block in first)),
                 sum(s.remaining for s in feeding)) if feeding else 0
    limit = caps.max_sequences_per_pass or len(first) + len(feeding)
    streams = opening_sessions(feeding, budget, len(first), limit)
    now, split = split_rounds(first, caps, limit - streams)
    keep = frozenset(seen | {s.spec.session_id for s in feeding})
    work = Pass(tuple(block for _, block in now), feeding, max(0, budget), streams, keep)
    return Plan(work, [i for i, _ in now], [i for i, _ in split], sorted(i for i, _ in later))


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


def prefill_tokens(budget_ms: float, ms_per_token: float | None, round_tokens: int, max_chunk: int,
                   others_waiting: bool, fed_last_step: bool) -> int:
    """How many prompt tokens a pass may carry beside `round_tokens` tokens of rounds.

    Nobody else waiting: `max_chunk`. Otherwise none beside rounds if the last pass fed the prompt,
    and else what the rounds leave of the budget at the measured cost per token, within
    [MIN_PREFILL_CHUNK, max_chunk]; before anything is measured, the least. The cost per token is a
    prompt pass's time over its tokens, fixed per-pass costs included, so on a slow machine (or deep
    in a long prompt, where each token attends to more) the chunk shrinks until a pass fits the
    budget or reaches the floor.
    """
    if not others_waiting and round_tokens == 0:
        return max_chunk
    if round_tokens and fed_last_step:
        return 0
    floor = min(MIN_PREFILL_CHUNK, max_chunk)
    if ms_per_token is None:
        return floor
    return max(floor, min(max_chunk, int(budget_ms / ms_per_token) - round_tokens))


class StepCost:
    """The running cost of a pass per token it feeds (ms), smoothed over the passes so far."""

    def __init__(self) -> None:
        self.ms_per_token: float | None = None

    def observe(self, seconds: float, tokens: int) -> None:
        """One pass that fed `tokens` tokens took `seconds`."""
        if tokens <= 0:
            return
        sample = 1e3 * seconds / tokens
        previous = self.ms_per_token
        self.ms_per_token = sample if previous is None else previous + COST_SMOOTHING * (sample - previous)


def tree_nodes(limit: int, caps: Capabilities) -> int:
    """The tree size a replica offers: the configured limit, none without tree masks, and never more
    leaves than one pass may carry."""
    if not caps.tree_masks:
        return 0
    return min(limit, caps.max_tree_leaves) if caps.max_tree_leaves else limit
