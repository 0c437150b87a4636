"""The cloud-only phase: the target decodes alone on one stream (edge/cloud_stream.py), while the edge keeps
measuring — the cloud's time per token T and the drafter's guesses against the cloud's tokens
("shadow drafting", which measures α and the drafter's time per token without risking a block; when
sampling, the guess is the drafter's coupled draw: edge/proposal.py SHADOW_SAMPLED_MODES) — and
every `probe_tokens` tokens asks the controller whether hybrid decoding would now be faster.

Shadow drafting uses the edge's idle time only: a token is guessed when the edge waited for it at least
as long as a guess takes. A guess longer than the wait would hold the cloud's next tokens back from the
user, and a drafter slower than the cloud would fall ever further behind the stream (a torch drafter
on the Ray pool: stalls of 100-300 ms, the default edge at 0.85-0.90x the Decode RPC's speed). One
token in SHADOW_UNAFFORDABLE_EVERY is guessed regardless, so that α and the guess's cost are still measured.

Shadow drafting needs the generation's `Drafting`: if there is none yet and the rule lets a guess be
checked, the phase builds it after the first token is handed on (once a drafter loading in the
background is there) and hands it back with the next phase, so that it is built once."""
from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator

from ..common.protocol.errors import HybridSpecError, Unavailable
from .cloud_stream import CloudStream
from .context import Drafting, Lost, RunContext, build_drafting, shadow_rule
from .controller import Phase
from .state import Event, Origin

# What the phase returns: the next phase (or Lost), and the generation's Drafting if there is one now.
CloudOnlyEnd = tuple[Phase | Lost, Drafting | None]

SHADOW_UNAFFORDABLE_EVERY = 8  # a guess longer than the wait for the token: one token in this many still


def run_cloud_only(ctx: RunContext, kit: Drafting | None) -> Generator[Event, None, CloudOnlyEnd]:
    """Stream cloud tokens until done, or until hybrid looks faster. kit: the generation's drafting,
    None if not built yet (built here for shadow drafting after the first token, once the drafter model
    is there). Returns the next phase (HYBRID: the main loop opens the hybrid session) and the drafting."""
    cfg, state, stats, ctl, estimates = ctx.cfg, ctx.state, ctx.stats, ctx.controller, ctx.estimates
    # 1. One stream for the rest of the budget, on a session of its own (edge/cloud_stream.py).
    stats.cloud_streams += 1
    # The open leaves first and the round-trip probe overlaps it. The drafter is set up (a llama.cpp
    # context, about 15 ms) only once the first token is out: the Decode request leaves when the stream
    # is first read, so setting it up before held back every generation's first token (never_slower:
    # 7 ms median, 17 mean, a tenth of a 10-token generation). Later tokens are pushed meanwhile.
    sent = time.perf_counter()
    cloud = CloudStream(ctx.client, ctx.spec, state, estimates, stats, cfg.link.timeout_s)
    cloud.start()
    stream = cloud.tokens(cfg.generation.max_new_tokens - state.generated)
    try:
        ping = _ping_in_background(ctx)
        loading = ctl.reconsiders  # no guesses, no decisions until the drafter is there (never: --cloud-only)
        can_shadow, to_guess = False, 0  # to_guess: shadow guesses left in this window
        streak = 0  # consecutive shadow agreements: the position a block would have reached
        guessed_at = -1  # the committed length at the last guess (-1: none in this phase)
        last = None
        next_check, since_check = ctl.first_check_after(can_shadow), 0
        for token, waited in _waits(stream):
            # 2. Measure: T from the gaps (the first token's wait holds the round trip and prefill), α by shadow.
            now = time.perf_counter()
            if last is not None:
                estimates.cloud_token_s.add(now - last)
            else:
                # What a switch to hybrid would cost: on a loaded replica seconds of queue, not the bare
                # prefill (8 edges: a 3 s stall after a switch).
                estimates.observe_open(now - sent, len(state.committed))
            last = now
            stats.cloud_only_tokens += 1
            yield state.commit([token], [Origin.CLOUD])  # the user first: guessing along can wait
            if state.done:
                break  # a stop string ends the generation before the stream does
            guess_s = estimates.draft_s.value
            since_guess = len(state.committed) - guessed_at if guessed_at >= 0 else SHADOW_UNAFFORDABLE_EVERY
            affordable = guess_s is None or waited >= guess_s or since_guess >= SHADOW_UNAFFORDABLE_EVERY
            if to_guess and affordable:
                to_guess -= 1
                if guessed_at != len(state.committed) - 1:
                    streak = 0  # after a gap, the position a block would have reached is unknown
                started = time.perf_counter()
                proposal = kit.drafter.propose(state.committed[:-1], 1, fallback=False)
                if guessed_at == len(state.committed) - 1:
                    # A real draft of one token (t_d) only if the drafter had guessed the token before: a
                    # first guess also feeds it the prompt, one after a gap the tokens it did not guess.
                    estimates.draft_s.add(time.perf_counter() - started)
                guessed_at = len(state.committed)
                stats.shadow_guesses += 1
                agreed = proposal.shadow_guess(cfg.generation.seed, len(state.committed) - 1) == token
                estimates.observe_shadow(agreed, min(streak, ctl.policy.cap))
                # Where the cloud's token stood among the drafter's choices: what sizes trees.
                estimates.observe_ranks(proposal.ranks_seen([], token))
                streak = streak + 1 if agreed and streak < ctl.policy.cap else 0
            if loading:
                if not ctx.load.ready():
                    continue
                # The drafter is there: built now if it may guess along, and the warm-up starts.
                if kit is None and shadow_rule(cfg):
                    kit = build_drafting(ctx)
                loading, can_shadow = False, kit is not None and kit.can_shadow
                next_check, since_check = ctl.first_check_after(can_shadow), 0
                to_guess = ctl.shadow_guesses(can_shadow, next_check)
            # 3. Decide, every so often.
            since_check += 1
            if not ctl.reconsiders or since_check < next_check:
                continue
            since_check, next_check = 0, cfg.policy.probe_tokens
            ping.join()
            ping = _ping_in_background(ctx)
            if ctl.hybrid_looks_better(can_shadow, state.max_new_tokens - state.generated, len(state.committed)):
                break
            if ctl.end_warmup():
                yield ctx.notice("staying with cloud-only decoding: predicted faster than hybrid here")
            to_guess = ctl.shadow_guesses(can_shadow, next_check)
    except Unavailable as exc:
        return Lost(exc), kit
    finally:
        stream.close()  # cancels the stream if we leave it early
        cloud.close()
    # 4. Done, or back to hybrid (the main loop opens a session from everything committed so far).
    return (Phase.CLOUD_ONLY if state.done or ctl.policy.settings.cloud_only else Phase.HYBRID), kit


def _waits(tokens: Iterator[int]) -> Iterator[tuple[int, float]]:
    """Each token with the seconds the edge waited for it (next to nothing: it was already waiting)."""
    while True:
        asked = time.perf_counter()
        try:
            token = next(tokens)
        except StopIteration:
            return
        yield token, time.perf_counter() - asked


def _ping_in_background(ctx: RunContext) -> threading.Thread:
    """Measure the round trip off the critical path (a cloud-only stream hides it otherwise)."""
    def ping() -> None:
        try:
            ctx.estimates.rtt_s.add(ctx.client.ping())
        except HybridSpecError:
            pass  # the stream itself reports an unreachable cloud

    thread = threading.Thread(target=ping, daemon=True, name="rtt-probe")
    thread.start()
    return thread
