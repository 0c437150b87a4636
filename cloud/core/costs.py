"""What a forward pass of M tokens costs this replica's engine: measured once when a replica starts.

The edge sizes its draft blocks from the verify cost t_v(γ) = t(γ + 1) (edge/policy.py). Guessing that
curve from the few block sizes an edge happens to try goes badly on CPUs, where t(M) is anything but
linear (llama.cpp's one-row kernels are far cheaper per token than its many-row ones, docs/engine.md);
the replica knows its own curve, so it measures it and reports it in GetModelInfo. The measurement is
one session alone over a short cached context, so it is the engine's cost, not the replica's load:
the edge adds what it measures on top (queueing, batching with others) as a residual.

On a GPU a pass of B sessions costs neither B one-session passes nor one: t(64 × 5) was 2.3 t(64 × 1)
on the 8B shape while t(1 × 5) was t(1 × 1). `measure_batch_costs` measures the curve again at the
batch sizes a pool runs (B sessions × M tokens each), so an edge among 64 sees what γ costs at 64.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from ..engine.base import Engine, Feed, Scores

CONTEXT_TOKENS = 128  # cached before timing: verify rounds extend a context, never an empty cache
REPEATS = 2  # per size, after a warm-up sweep; the fastest is reported (the least disturbed by the machine)
# Every size up to 8 (where CPU kernels change most), then coarser; the edge interpolates between.
# A replica measures before serving: on one CPU core the whole curve to 32 takes about 3 s.
SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)
BATCH_SESSIONS = (8, 64)  # B measured beside one session on a GPU (a CPU replica measures none)
PREFILL_SESSIONS = 8  # sessions whose contexts one prefill pass feeds while setting up a batch


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


def measure_batch_costs(engine: Engine, vocab_size: int, max_tokens: int, sessions: Sequence[int] = BATCH_SESSIONS,
                        repeats: int = REPEATS) -> tuple[tuple[int, int, float], ...]:
    """(B, M, milliseconds, the fastest of `repeats`) of a scored pass of B sessions × M tokens each after
    CONTEXT_TOKENS cached tokens each, for every B in `sessions` whose contexts fit the engine's free
    cache and every M of `cost_sizes(max_tokens)`; interleaved across repeats as measure_pass_costs.
    Leaves the engine as it was."""
    sizes = cost_sizes(max_tokens)
    out: list[tuple[int, int, float]] = []
    for b in sorted(set(sessions)):
        kvs = [engine.new_sequence() for _ in range(b)]
        try:
            if not sizes or b < 2 or not all(_take(engine, kv, CONTEXT_TOKENS + max_tokens) for kv in kvs):
                continue
            for i in range(0, b, PREFILL_SESSIONS):
                engine.forward([Feed(kv, _tokens(CONTEXT_TOKENS, vocab_size, j), scored=False)
                                for j, kv in enumerate(kvs[i:i + PREFILL_SESSIONS], start=i)])
            times: dict[int, list[float]] = {m: [] for m in sizes}
            for r in range(repeats + 1):  # the first sweep warms the kernels up and is not kept
                for m in sizes:
                    for kv in kvs:  # the room a truncate gave back
                        engine.reserve(kv, m)
                    feeds = [Feed(kv, _tokens(m, vocab_size, CONTEXT_TOKENS + r + j), scored=True)
                             for j, kv in enumerate(kvs)]
                    t0 = time.perf_counter()
                    _settle(engine.forward(feeds))
                    elapsed = (time.perf_counter() - t0) * 1e3
                    for kv in kvs:
                        engine.truncate(kv, CONTEXT_TOKENS)
                    if r:
                        times[m].append(elapsed)
            out += [(b, m, round(min(times[m]), 3)) for m in sizes]
        finally:
            for kv in kvs:
                engine.release(kv)
    return tuple(out)


def _take(engine: Engine, kv, tokens: int) -> bool:
    """Room for `tokens` tokens of `kv`, if the free cache has it."""
    if not engine.fits(kv, tokens):
        return False
    engine.reserve(kv, tokens)
    return True


def time_pass(engine: Engine, kv, start: int, tokens: Sequence[int], parents: tuple[int, ...] | None = None,
              keep: Sequence[int] | None = None) -> tuple[float, float]:
    """(ms of one scored pass of `tokens` after `start` cached tokens, ms of then keeping rows `keep` or
    0.0); the cache is cut back to `start` afterwards. `parents` makes the pass a tree (engine/base.py).
    The one pass timer: the replica's curve above and the benchmarks (bench/harness.py) use it."""
    engine.reserve(kv, len(tokens))
    t0 = time.perf_counter()
    _settle(engine.forward([Feed(kv, list(tokens), scored=True, parents=parents)]))
    t1 = time.perf_counter()
    if keep is not None:
        engine.keep_rows(kv, start, list(keep))
    t2 = time.perf_counter()
    engine.truncate(kv, start)
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3 if keep is not None else 0.0


def _settle(scores: Sequence[Scores]) -> None:
    """Wait for the pass: on a GPU `forward` returns once its work is queued, and reading one score back
    waits for everything queued before it (on a CPU it is already done)."""
    float(scores[-1].logits[-1, 0])


def _tokens(count: int, vocab_size: int, salt: int) -> Sequence[int]:
    """Ordinary-looking ids spread over the vocabulary (no model cost depends on which)."""
    return [(7919 * (i + salt) + 17) % vocab_size for i in range(count)]
