"""The offline phase (`allow_unverified`): the cloud stopped answering, so the drafter goes on alone and
its tokens are marked unverified. The edge tries the cloud again after `reconnect_s`, then at doubling
intervals (at most RECONNECT_MAX_S apart); once it answers, the
unverified tail is verified block by block with the ordinary verify round — the longest accepted
prefix is kept and the rest rolled back, so the final text is still the target's."""
from __future__ import annotations

import time
from collections.abc import Generator
from typing import TYPE_CHECKING

from ..common.protocol.errors import Unavailable
from .controller import Phase
from .state import Event

if TYPE_CHECKING:
    from .phases import RunView

RECONNECT_MAX_S = 10.0  # the longest wait between two attempts to reach the cloud
STOP_WINDOW = 64  # unverified tokens searched for a stop string


def run_offline(run: RunView) -> Generator[Event, None, Phase]:
    """Draft alone until the cloud answers, then verify what was drafted; returns the next phase."""
    cfg, state = run.cfg, run.state
    yield run.notice(f"cloud unreachable ({run.lost_reason}); continuing with the drafter alone, unverified")
    if run.in_flight is not None and run.in_flight.ids:
        yield _add_unverified(run, run.in_flight)
    run.in_flight = None
    delay = cfg.reconnect_s
    next_try = time.perf_counter() + delay
    give_up = None  # set once there is nothing left to draft
    while True:
        # 1. Time to try the cloud again?
        now = time.perf_counter()
        if now >= next_try:
            delay = min(2 * delay, max(RECONNECT_MAX_S, cfg.reconnect_s))
            next_try = now + delay
            if _reachable(run):
                yield run.notice(f"cloud reachable again; verifying {len(state.unverified)} unverified tokens")
                return (yield from _verify_unverified(run))
        # 2. Draft one more token alone, while the budget allows.
        if state.room > 0 and not _ended(run):
            proposal = run.drafter.propose(state.committed + state.unverified, 1, fallback=False)
            yield from run.drafter_notice()
            if proposal.ids:
                yield _add_unverified(run, proposal)
                continue
        # 3. Nothing left to draft: wait for the cloud, but not for ever.
        give_up = give_up or now + cfg.timeout_s
        if now > give_up:
            run.gave_up = True
            yield run.notice(f"cloud still unreachable after {cfg.timeout_s:g} s; "
                             f"{len(state.unverified)} tokens stay unverified")
            return Phase.OFFLINE
        time.sleep(max(0.0, min(next_try, give_up) - now))


def _ended(run: RunView) -> bool:
    """The unverified tail ends with an end-of-sequence token or holds a stop string: draft no further."""
    tail = run.state.unverified
    if tail and tail[-1] in run.state.stop_ids:
        return True
    text = run.worker.codec.decode(tail[-STOP_WINDOW:]) if run.cfg.stop and tail else ""
    return any(stop in text for stop in run.cfg.stop)


def _reachable(run: RunView) -> bool:
    """Ping the cloud (checking the pair if it never answered before) and re-open the session; False
    while it does not answer."""
    try:
        run.client.ping(timeout_s=min(run.cfg.reconnect_s, run.cfg.timeout_s))
        if not run.worker.connected:
            run.worker.connect(run.client)
        run.open_hybrid()
        return True
    except Unavailable:
        return False


def _add_unverified(run: RunView, proposal) -> Event:
    run.stats.offline_tokens += len(proposal.ids)
    return run.state.add_unverified(proposal)


def _verify_unverified(run: RunView) -> Generator[Event, None, Phase]:
    """Send the unverified tail as draft blocks; keep what is accepted, roll back the rest."""
    state = run.state
    while state.unverified and not state.done:
        block = state.unverified_block(run.controller.policy.cap, with_q=not run.cfg.sampling.greedy)
        try:
            result, events = run.verify_round(block, len(block.ids), unverified=True)
        except Unavailable as exc:
            return run.lost(exc, None)
        run.estimates.observe_verify(len(block.ids), result.verify_ms / 1e3)
        yield from events
    return Phase.HYBRID
