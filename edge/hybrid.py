"""The hybrid phase: one round of drafting on the edge and verifying in the cloud.

    1. decide   a chain of γ, a tree, or hand decoding to the cloud (edge/controller.py)
    2. draft    unless the last wait already drafted this block (edge/drafter.py `Lookahead`)
    3. verify   send it, draft the next block while it is scored, commit the verdict (edge/rounds.py)
    4. learn    acceptance, ranks and the verifier's time go into the worker's estimates

The session the round is sent on is open: the main loop (edge/worker.py) opens it before the first
round of each hybrid stretch.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Generator

from ..common.protocol.errors import Unavailable
from .context import Drafting, Lost, RunContext
from .controller import Phase
from .rounds import InFlight
from .state import Event, EventKind


def hybrid_round(ctx: RunContext, kit: Drafting) -> Generator[Event, None, Phase | Lost]:
    """One verify round; returns HYBRID for another, CLOUD_ONLY when the cloud should decode alone, or
    Lost (with the block that was in flight) when the cloud stopped answering."""
    state, drafter = ctx.state, kit.drafter
    remaining = state.max_new_tokens - state.generated  # the budget left; nothing commits until step 3's verdict
    # 1. Decide: a chain of γ, a tree, or let the cloud decode alone. The verifier always adds a token.
    shape = ctx.controller.next_shape(remaining, len(state.committed))
    if shape is None:
        drafter.drop()
        ctx.stats.switches_to_cloud += 1
        kit.session.close(wait=False)  # the cloud-only stream opens a session of its own
        yield ctx.notice("switched to cloud-only decoding: hybrid is predicted slower than cloud-only decoding")
        return Phase.CLOUD_ONLY
    depth = min(shape.depth, remaining - 1)
    # 2. Draft (unless the last wait already did).
    t0 = time.perf_counter()
    if shape.is_chain or depth == 0:  # the last token of the budget is the verifier's alone
        proposal = drafter.propose(state.committed, depth)
    else:
        from .tree_draft import TreeBudget, draft_tree  # with the drafter: a tree needs its torch

        budget = TreeBudget(shape.nodes, depth, shape.top_k)
        proposal = drafter.propose_tree(depth, lambda inner: draft_tree(inner, state.committed, budget))
    yield from kit.notices(ctx)
    if not proposal.drafted_ahead:
        spent = time.perf_counter() - t0
        ctx.stats.draft_s += spent
        if proposal.ids:
            per_token = ctx.estimates.draft_s if proposal.parents is None else ctx.estimates.tree_node_s
            per_token.add(spent / len(proposal.ids))
    main = proposal.main_path()
    if proposal.ids:
        yield Event(EventKind.DRAFT, provisional=tuple(main.ids))
    # 3. Verify it. Pipelining: while it is scored, draft the guessed bonus token and the next block as
    #    if all of this one (a tree: its main path) were accepted, where the budget has room for them.
    room = remaining - len(main.ids) - 1
    draft_ahead: Callable[[InFlight], None] | None = None
    if ctx.cfg.policy.pipeline and depth > 0 and room >= 2 and not (main.ids and main.ids[-1] in state.stop_ids):
        def draft_ahead(flight: InFlight) -> None:
            drafter.prefetch(state.committed, main, min(depth + 1, room), interrupt=flight.done)
    try:
        result, nodes, events = kit.verify_round(proposal, shape.nodes, while_waiting=draft_ahead)
    except Unavailable as exc:
        return Lost(exc, proposal)
    yield from events
    # 4. Learn: acceptance per position (a tree's main path stands for the chain it contains) and
    #    per rank, the verifier's time per block size, the network's share.
    main_nodes = proposal.main_nodes()
    kept = next((i for i, (a, b) in enumerate(zip(nodes, main_nodes)) if a != b), min(len(nodes), len(main_nodes)))
    ctx.estimates.observe_round(len(main_nodes), kept, drafter.guess_right)
    ctx.estimates.observe_ranks(proposal.ranks_seen(nodes, result.next_token))
    ctx.estimates.observe_verify(len(proposal.ids), result.verify_ms / 1e3)
    ctx.controller.observed_hybrid_round()
    return Phase.HYBRID
