"""What a forward pass of M tokens costs this replica's engine: measured once when a replica starts.

The edge sizes its draft blocks from the verify cost t_v(γ) = t(γ + 1) (edge/policy.py). Guessing that
curve from the few block sizes an edge happens to try goes badly on CPUs, where t(M) is anything but
linear (llama.cpp's one-row kernels are far cheaper per token than its many-row ones, docs/engine.md);
the replica knows its own curve, so it measures it and reports it in GetModelInfo. The measurement is
one session alone over a short cached context, so it is the engine's cost, not the replica's load:
the edge adds what it measures on top (queueing, batching with others) as a residual.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from ..engine.base import Engine, Feed

CONTEXT_TOKENS = 128  # cached before timing: verify rounds extend a context, never an empty cache
REPEATS = 2  # per size, after a warm-up sweep; the fastest is reported (the least disturbed by the machine)
# Every size up to 8 (where CPU kernels change most), then coarser; the edge interpolates between.
# A replica measures before serving: on one CPU core the whole curve to 32 takes about 3 s.
SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)


def cost_sizes(max_tokens: int) -> tuple[int, ...]:
    """The pass sizes measured for a curve up to `max_tokens` (which is always among them)."""
    if max_tokens < 1:
        return ()
    return tuple(m for m in SIZES if m < max_tokens) + (max_tokens,)


def measure_pass_costs(engine: Engine, vocab_size: int, max_tokens: int,
                       repeats: int = REPEATS) -> tuple[tuple[int, float], ...]:
    """(M, milliseconds, the fastest of `repeats`) of a scored pass of M tokens after CONTEXT_TOKENS cached ones, for the
    sizes of `cost_sizes(max_tokens)`; sizes are interleaved across repeats so that a slow moment of the
    machine spreads over all of them instead of bending the curve. Leaves the engine as it was."""
    sizes = cost_sizes(max_tokens)
    if not sizes:
        return ()
    kv = engine.new_sequence()
    try:
        engine.reserve(kv, CONTEXT_TOKENS)
        engine.forward([Feed(kv, _tokens(CONTEXT_TOKENS, vocab_size, 0), scored=False)])
        times: dict[int, list[float]] = {m: [] for m in sizes}
        for r in range(repeats + 1):  # the first sweep warms the kernels up and is not kept
            for m in sizes:
                elapsed, _ = time_pass(engine, kv, CONTEXT_TOKENS, _tokens(m, vocab_size, CONTEXT_TOKENS + r))
                if r:
                    times[m].append(elapsed)
    finally:
        engine.release(kv)
    return tuple((m, round(min(times[m]), 3)) for m in sizes)


def time_pass(engine: Engine, kv, start: int, tokens: Sequence[int], parents: tuple[int, ...] | None = None,
              keep: Sequence[int] | None = None) -> tuple[float, float]:
    """(ms of one scored pass of `tokens` after `start` cached tokens, ms of then keeping rows `keep` or
    0.0); the cache is cut back to `start` afterwards. `parents` makes the pass a tree (engine/base.py).
    The one pass timer: the replica's curve above and the benchmarks (bench/harness.py) use it."""
    engine.reserve(kv, len(tokens))
    t0 = time.perf_counter()
    engine.forward([Feed(kv, list(tokens), scored=True, parents=parents)])
    t1 = time.perf_counter()
    if keep is not None:
        engine.keep_rows(kv, start, list(keep))
    t2 = time.perf_counter()
    engine.truncate(kv, start)
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3 if keep is not None else 0.0


def _tokens(count: int, vocab_size: int, salt: int) -> Sequence[int]:
    """Ordinary-looking ids spread over the vocabulary (no model cost depends on which)."""
    return [(7919 * (i + salt) + 17) % vocab_size for i in range(count)]
