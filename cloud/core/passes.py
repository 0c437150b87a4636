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

Fair share by identity (`fair_rounds`). Sessions belong to tenants: the identity that opened them (a
token's name, or the address of a caller without one), each with a weight from the credentials file.
While more than one tenant is active (has a round queued, a prompt being fed, or sent a round within
the last half second), a pass is sized to `budget_ms` of predicted time and filled round by round,
each time from the tenant that has had the least pass time over its weight (its virtual time,
`Usage`); a tenant alone gets every round the engine may carry, as before. The unit is measured pass
time, not tokens: on a CPU a token at 3,000 cached tokens costs about twice one at 100 (attention),
so a tenant of long sessions would take twice its share of the engine per token. Each pass's time is
measured and split over its feeds by a model fitted to every pass (`PassTime`: a fixed part, a part
per token and a part per token and cached token), and each tenant is charged its feeds' part.

Streams (`stream_rounds`). An engine that holds fewer sessions in its fast memory than it serves
(llama.cpp's `kv_streams`) parks the others in host memory, and restoring a 3,000-token session
costs about as much as a pass. Choosing rounds by arrival alone rotated every session through the
streams on every pass. Instead a round of a session that has no stream goes only where that moves no
busy session out (a free stream, or one whose holder sent nothing lately), where its tenant holds
less than its weighted share of the streams (then it takes one from the tenant most over its share),
or, in turn, once a holder of the tenant most over its share has had its stream for `ROTATION_S`:
sessions beyond the streams are served in runs, not one pass each.
"""
from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ...common.protocol.tree import leaves
from ...common.protocol.wire import DraftBlock
from ..engine.base import Capabilities
from .session import Phase, Session

MIN_PREFILL_CHUNK = 4  # a prompt pass always carries this much, however tight the budget
COST_SMOOTHING = 0.3  # weight of the newest pass in the running cost per token
# A session that got a stream keeps it this long while it has rounds, unless a tenant under its share
# of the streams needs one. Parking and restoring a 3,000-token session costs about 0.2 s on a CPU
# core, so 8 streams turning over every 10 s cost about a sixth of the replica's time.
ROTATION_S = 10.0
PASS_TIME_MEMORY = 0.95  # weight of the passes before the newest in the pass-time model
PASS_TIME_PRIOR = 1e-3  # how strongly the model holds to its prior (the start-up curve) against passes


@dataclass(frozen=True)
class Shares:
    """What `plan_pass` knows about who asks (all pure data, gathered by the verifier's step 2)."""

    tenant: Mapping[str, str]  # session id -> its tenant (identity name; a caller's address without a token)
    weight: Mapping[str, float]  # tenant -> weight (1 where absent)
    usage: Mapping[str, float]  # tenant -> its virtual time: ms of passes charged to it over its weight
    active: frozenset[str]  # tenants with work now or a round within the active window
    budget_ms: float  # a pass's predicted time while several tenants are active
    cost: Callable[[DraftBlock], float]  # predicted ms a round adds to a pass
    ages: Sequence[float] = ()  # per offered block, seconds since it arrived
    # An engine that parks: resident session id -> seconds it has held its stream; None: every session
    # stays in fast memory (torch's pool), so no round waits for a stream.
    resident: Mapping[str, float] | None = None
    streams: int = 0  # the engine's streams (sessions resident at once)
    recent: frozenset[str] = frozenset()  # sessions that sent a round within the active window

    def of(self, session_id: str) -> str:
        """The tenant of a session ("" if unknown: its round fails at admission anyway)."""
        return self.tenant.get(session_id, "")

    def weight_of(self, tenant: str) -> float:
        return self.weight.get(tenant, 1.0)


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
    def running(self) -> frozenset[str]:
        """The sessions this pass feeds (its rounds' and its openings'): never evicted while it is planned."""
        return frozenset(block.session_id for block in self.rounds) | {s.spec.session_id for s in self.openings}

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
              caps: Capabilities, max_rounds: int, shares: Shares | None = None) -> Plan:
    """The next pass over `blocks` (in arrival order) and `openings` (oldest first).

    1. One round per session (a session's rounds are scored one after the other, never together).
    2. With `shares` of an engine that parks: the rounds that can run without parking a busy session
       (`stream_rounds`); the others wait.
    3. The rounds of this pass: while several tenants are active, a fair share of `shares.budget_ms`
       (`fair_rounds`); else the first `max_rounds`.
    4. The prompt tokens the pass may carry beside those rounds: `prefill(round tokens)` (not asked
       when no opening is prefilling).
    5. How many openings get a chunk, within the engine's sessions per pass (`opening_sessions`).
    6. The rounds the engine can take beside them (`split_rounds`); the rest go to the next pass.
    Every session offered a round or being opened is kept from eviction while the pass makes room.
    """
    first, later, seen = [], [], set()  # (index, block) pairs; seen: every offered block's session
    for i, block in enumerate(blocks):
        (later if block.session_id in seen else first).append((i, block))
        seen.add(block.session_id)
    feeding = tuple(s for s in openings if s.phase is Phase.PREFILLING)
    if shares is not None and shares.resident is not None:
        first, held = stream_rounds(first, shares)
        later += held
    first, more = fair_rounds(first, shares, max_rounds)
    later += more
    budget = min(prefill(sum(len(block.draft_ids) + 1 for _, block in first)),
                 sum(s.remaining for s in feeding)) if feeding else 0
    limit = caps.max_sequences_per_pass or len(first) + len(feeding)
    streams = opening_sessions(feeding, budget, len(first), limit)
    now, split = split_rounds(first, caps, limit - streams)
    keep = frozenset(seen | {s.spec.session_id for s in feeding})
    work = Pass(tuple(block for _, block in now), feeding, max(0, budget), streams, keep)
    return Plan(work, [i for i, _ in now], [i for i, _ in split], sorted(i for i, _ in later))


Item = tuple[int, DraftBlock]  # a block offered to a pass, with its index among the blocks offered


def fair_rounds(items: list[Item], shares: Shares | None, max_rounds: int) -> tuple[list[Item], list[Item]]:
    """(rounds for this pass, in the order offered; rounds for later). A tenant alone (or no `shares`):
    the first `max_rounds`. Several active tenants: round by round, the next round of the tenant with
    the least virtual time (ties: by name), each adding its predicted time to the pass and its cost over
    the tenant's weight to the tenant's virtual time. The first round always goes; another goes only
    while the pass stays within `budget_ms` and its tenant's clock is not ahead of any other active
    tenant's (one with nothing queued now will be back with its next round: the pass ends for it rather
    than run long). A tenant's rounds go in the order offered."""
    active = shares.active | {shares.of(b.session_id) for _, b in items} if shares is not None else set()
    if len(active) <= 1:
        return items[:max_rounds], items[max_rounds:]
    queues: dict[str, deque[Item]] = {}
    for item in items:
        queues.setdefault(shares.of(item[1].session_id), deque()).append(item)
    floor = min((shares.usage.get(t, 0.0) for t in active), default=0.0)
    clock = {t: shares.usage.get(t, floor) for t in active}
    now: list[Item] = []
    total = 0.0
    while queues and len(now) < max_rounds:
        tenant = min(queues, key=lambda t: (clock[t], t))
        item = queues[tenant][0]
        cost = max(0.0, shares.cost(item[1]))
        ahead = any(clock[tenant] > clock[t] for t in active if t != tenant)
        if now and (total + cost > shares.budget_ms or ahead):
            break
        queues[tenant].popleft()
        if not queues[tenant]:
            del queues[tenant]
        now.append(item)
        total += cost
        clock[tenant] += cost / shares.weight_of(tenant)
    rest = [item for queue in queues.values() for item in queue]
    return sorted(now, key=lambda item: item[0]), rest


def stream_rounds(items: list[Item], shares: Shares) -> tuple[list[Item], list[Item]]:
    """(rounds that may run now, rounds that wait) on an engine that parks sessions beyond its streams.

    A resident session's round runs unless its session is moved out for another. A round of a session
    without a stream (the longest waiting first) runs if it can have one: a free stream or one whose
    holder has nothing queued and sent nothing lately; else one taken from the tenant most over its
    share of the streams (streams × weight / the weights of the tenants holding or asking for one),
    at once when its own tenant holds less than its share, else only from a holder that has had its
    stream for ROTATION_S. The holder taken from waits (the engine parks it when the pass runs)."""
    resident = shares.resident or {}
    offered = {block.session_id for _, block in items}
    holders = [sid for sid in resident if sid in offered or sid in shares.recent]  # busy residents
    free = shares.streams - len(holders)
    held = Counter(shares.of(sid) for sid in holders)
    tenants = set(held) | {shares.of(sid) for sid in offered}
    weights = sum(shares.weight_of(t) for t in tenants)
    share = {t: shares.streams * shares.weight_of(t) / weights for t in tenants}
    moved, entering = set(), set()

    def excess(tenant: str) -> float:
        return held[tenant] - share.get(tenant, 0.0)

    def take_from(tenant: str, at_once: bool) -> str | None:
        """The longest-resident holder that may be moved out for a session of `tenant`: at once, only
        from a tenant over its share; in turn, only one that had its stream ROTATION_S, of the tenant
        most over its share among those at least as far over as `tenant` (itself included)."""
        for victim_tenant in sorted(held, key=lambda t: (-excess(t), t != tenant)):
            if at_once and excess(victim_tenant) <= 0:
                return None
            if not at_once and excess(victim_tenant) < excess(tenant) and victim_tenant != tenant:
                return None
            movable = [sid for sid in holders if shares.of(sid) == victim_tenant and sid not in moved
                       and (at_once or resident[sid] >= ROTATION_S)]
            if movable:
                return max(movable, key=lambda sid: (resident[sid], sid))
        return None

    outsiders = sorted((item for item in items if item[1].session_id not in resident),
                       key=lambda item: (-_age(shares, item[0]), item[0]))
    for _, block in outsiders:
        tenant = shares.of(block.session_id)
        if free > 0:
            free -= 1
        else:
            victim = take_from(tenant, at_once=True) if excess(tenant) < 0 else None
            victim = victim or take_from(tenant, at_once=False)
            if victim is None:
                continue
            moved.add(victim)
            held[shares.of(victim)] -= 1
        entering.add(block.session_id)
        held[tenant] += 1
    runs = {sid for sid in offered if (sid in resident and sid not in moved) or sid in entering}
    return [item for item in items if item[1].session_id in runs], [item for item in items
                                                                     if item[1].session_id not in runs]


def _age(shares: Shares, index: int) -> float:
    return shares.ages[index] if index < len(shares.ages) else 0.0


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


class PassTime:
    """A pass's time (ms) as a model fitted to every pass the replica runs: a fixed part, a part per
    token fed and a part per token fed and token cached before it (attention), over recent passes
    (exponential forgetting), held towards the start-up curve (`ModelInfo.pass_costs`, measured over
    a short context) where passes say little. `feed_ms` is what a feed adds: how `fair_rounds` sizes a
    pass and how a measured pass's time is split over its tenants."""

    def __init__(self, points: Sequence[tuple[int, float]] = ()) -> None:
        """points: (tokens, ms) of passes over a short cached context, if measured."""
        if len(points) >= 2:
            tokens, ms = np.array(points, dtype=float).T
            slope, fixed = np.polyfit(tokens, ms, 1)
            prior = (max(0.0, float(fixed)), max(0.01, float(slope)), 0.0)
        else:
            prior = (0.0, 1.0, 0.0)
        # The fit in plain floats: numpy's per-call cost would be most of a pass's accounting.
        self._gram = [[PASS_TIME_PRIOR * (i == j) for j in range(3)] for i in range(3)]
        self._moment = [PASS_TIME_PRIOR * p for p in prior]
        # What each observation adds to hold the fit towards the prior: the same every pass.
        self._pull_gram = [[(1 - PASS_TIME_MEMORY) * g for g in row] for row in self._gram]
        self._pull_moment = [(1 - PASS_TIME_MEMORY) * m for m in self._moment]
        self.coef = prior  # ms: fixed, per token, per token per thousand tokens cached

    def feed_ms(self, tokens: int, cached: int) -> float:
        """What a feed of `tokens` after `cached` cached tokens adds to a pass."""
        return tokens * (self.coef[1] + self.coef[2] * cached / 1e3)

    def observe(self, feeds: Sequence[tuple[int, int]], ms: float) -> None:
        """A pass of `feeds` ((tokens, cached) each) took `ms`."""
        if not feeds or not ms > 0:
            return
        x = (1.0, sum(t for t, _ in feeds), sum(t * c for t, c in feeds) / 1e3)
        m = PASS_TIME_MEMORY
        self._gram = [[m * g + xi * xj + pull for g, xj, pull in zip(row, x, pulls)]
                      for row, xi, pulls in zip(self._gram, x, self._pull_gram)]
        self._moment = [m * v + xi * ms + pull for v, xi, pull in zip(self._moment, x, self._pull_moment)]
        coef = solve(self._gram, self._moment)
        if coef is not None and all(math.isfinite(c) for c in coef):
            self.coef = (max(coef[0], 0.0), max(coef[1], 0.01), max(coef[2], 0.0))

    def split(self, feeds: Sequence[tuple[int, int]], ms: float) -> list[float]:
        """A measured pass's `ms`, split over its feeds in proportion to what each adds."""
        parts = [self.feed_ms(t, c) for t, c in feeds]
        total = sum(parts)
        return [ms * p / total for p in parts] if total > 0 else [ms / len(feeds)] * len(feeds)


def solve(a: Sequence[Sequence[float]], b: Sequence[float]) -> list[float] | None:
    """x with a·x = b, by Gaussian elimination with partial pivoting (LAPACK's method for a small
    system, in plain floats); None if `a` is singular."""
    n = len(b)
    rows = [[*row, v] for row, v in zip(a, b)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        if rows[col][col] == 0.0:
            return None
        for r in range(col + 1, n):
            f = rows[r][col] / rows[col][col]
            rows[r] = [v - f * w for v, w in zip(rows[r], rows[col])]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (rows[r][n] - sum(rows[r][c] * x[c] for c in range(r + 1, n))) / rows[r][r]
    return x


@dataclass
class Usage:
    """Each active tenant's virtual time: the pass time charged to it (ms) over its weight. A tenant
    that becomes active starts level with the least served of those already active, so time spent idle
    is never banked into a burst later."""

    clock: dict[str, float] = field(default_factory=dict)

    def settle(self, active: Iterable[str]) -> dict[str, float]:
        """Forget the tenants no longer active, start the new ones level; the clocks, for `Shares.usage`."""
        active = set(active)
        self.clock = {t: v for t, v in self.clock.items() if t in active}
        floor = min(self.clock.values(), default=0.0)
        for tenant in active - set(self.clock):
            self.clock[tenant] = floor
        if floor:  # keep the numbers small: only differences matter
            self.clock = {t: v - floor for t, v in self.clock.items()}
        return dict(self.clock)

    def charge(self, tenant: str, ms: float, weight: float) -> None:
        """`tenant` used `ms` of a pass."""
        self.clock[tenant] = self.clock.get(tenant, 0.0) + ms / weight


def tree_nodes(limit: int, caps: Capabilities) -> int:
    """The tree size a replica offers: the configured limit, none without tree masks, and never more
    leaves than one pass may carry."""
    if not caps.tree_masks:
        return 0
    return min(limit, caps.max_tree_leaves) if caps.max_tree_leaves else limit
