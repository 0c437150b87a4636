"""The offline phase (`allow_unverified`): the cloud stopped answering, so the drafter goes on alone and
its tokens are marked unverified. The edge tries the cloud again after `reconnect_s`, then at doubling
intervals (at most RECONNECT_MAX_S apart); once it answers, the main loop (edge/worker.py) re-opens
the session and the unverified tail is verified block by block with the ordinary verify round
(`verify_unverified`) — the longest accepted prefix is kept and the rest rolled back, so the final
text is still the target's."""
from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass

from ..common.protocol.errors import Unavailable
from .context import Drafting, GaveUp, Lost, RunContext
from .controller import Phase
from .proposal import Proposal
from .state import Event

RECONNECT_MAX_S = 10.0  # the longest wait between two attempts to reach the cloud
STOP_WINDOW = 64  # unverified tokens searched for a stop string


@dataclass
class Outage:
    """When to try the cloud next, and when to stop waiting for it: kept across the offline phase's
    returns while the cloud answers pings but not yet the session's re-open."""

    delay: float  # seconds until the next attempt after this one
    next_try: float  # perf_counter time of the next attempt
    give_up: float | None = None  # perf_counter time to give up at, once nothing is left to draft


def go_offline(ctx: RunContext, kit: Drafting | None, lost: Lost) -> Generator[Event, None, Outage]:
    """Say the cloud is gone and keep the block that was in flight, unverified; returns the outage's
    reconnect schedule. Raises the loss itself unless `allow_unverified`."""
    if not ctx.cfg.link.allow_unverified:
        raise lost.error
    if kit is not None:
        kit.drafter.drop()  # whatever was drafted ahead followed a block that is not committed
    yield ctx.notice(f"cloud unreachable ({lost.error}); continuing with the drafter alone, unverified")
    if lost.in_flight is not None and lost.in_flight.ids:
        yield _add_unverified(ctx, lost.in_flight)
    delay = ctx.cfg.link.reconnect_s
    return Outage(delay, time.perf_counter() + delay)


def run_offline(ctx: RunContext, kit: Drafting, outage: Outage) -> Generator[Event, None, Phase | GaveUp]:
    """Draft alone until the cloud answers a ping (returns HYBRID: the main loop re-opens the session
    and verifies what was drafted), or, with nothing left to draft, until `timeout_s` has passed
    (returns GaveUp: the main loop ends the generation with its notice)."""
    cfg, state = ctx.cfg, ctx.state
    while True:
        # 1. Time to try the cloud again?
        now = time.perf_counter()
        if now >= outage.next_try:
            outage.delay = min(2 * outage.delay, max(RECONNECT_MAX_S, cfg.link.reconnect_s))
            outage.next_try = now + outage.delay
            if _answers(ctx):
                return Phase.HYBRID
        # 2. Draft one more token alone, while the budget allows.
        if state.room > 0 and not _ended(ctx):
            proposal = kit.drafter.propose(state.committed + state.unverified, 1, fallback=False)
            yield from kit.notices(ctx)
            if proposal.ids:
                yield _add_unverified(ctx, proposal)
                continue
        # 3. Nothing left to draft: wait for the cloud, but not for ever.
        outage.give_up = outage.give_up or now + cfg.link.timeout_s
        if now > outage.give_up:
            return GaveUp(f"cloud still unreachable after {cfg.link.timeout_s:g} s; "
                          f"{len(state.unverified)} tokens stay unverified")
        time.sleep(max(0.0, min(outage.next_try, outage.give_up) - now))


def verify_unverified(ctx: RunContext, kit: Drafting) -> Generator[Event, None, Phase | Lost]:
    """Send the unverified tail as draft blocks on the re-opened session; keep what is accepted, roll
    back the rest. Returns HYBRID, or Lost if the cloud went away again."""
    state = ctx.state
    yield ctx.notice(f"cloud reachable again; verifying {len(state.unverified)} unverified tokens")
    while state.unverified and not state.done:
        block = state.unverified_block(ctx.controller.policy.cap, with_q=not ctx.cfg.sampling.greedy)
        try:
            result, _, events = kit.verify_round(block, len(block.ids), unverified=True)
        except Unavailable as exc:
            return Lost(exc)
        ctx.estimates.observe_verify(len(block.ids), result.verify_ms / 1e3)
        yield from events
    return Phase.HYBRID


def _ended(ctx: RunContext) -> bool:
    """The unverified tail ends with an end-of-sequence token or holds a stop string: draft no further."""
    tail = ctx.state.unverified
    if tail and tail[-1] in ctx.state.stop_ids:
        return True
    text = ctx.link.codec.decode(tail[-STOP_WINDOW:]) if ctx.cfg.generation.stop and tail else ""
    return any(stop in text for stop in ctx.cfg.generation.stop)


def _answers(ctx: RunContext) -> bool:
    """Ping the cloud, checking the pair if it never answered before; False while it does not answer."""
    try:
        ctx.client.ping(timeout_s=min(ctx.cfg.link.reconnect_s, ctx.cfg.link.timeout_s))
        if not ctx.link.connected:
            ctx.link.connect(ctx.client)
        return True
    except Unavailable:
        return False


def _add_unverified(ctx: RunContext, proposal: Proposal) -> Event:
    ctx.stats.offline_tokens += len(proposal.ids)
    return ctx.state.add_unverified(proposal)
