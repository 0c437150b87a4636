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

A replica does not wait for its curve to serve (cloud/pool/replica.py): it takes the curve kept from
an earlier start on the same model and hardware (cloud/core/cost_cache.py), or else measures it while
it serves (`CurveMeasurement`, `measure_in_background`): a pass at a time, first thing in a step of its
model thread, and only while no session is open. A round or an open that arrives meanwhile waits for
one pass at most (the context's prefill, or one pass of up to `pass_cost_tokens`); as soon as a session
is open the measurement gives its context back, so that no session ever waits for room it holds, and
goes on once the replica is idle again, the sweep it was in started over.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from ...common.protocol.errors import ResourceExhausted
from ..engine.base import Engine, Feed, Scores

log = logging.getLogger(__name__)

CONTEXT_TOKENS = 128  # cached before timing: verify rounds extend a context, never an empty cache
REPEATS = 2  # per size, after a warm-up sweep; the fastest is reported (the least disturbed by the machine)
# Every size up to 8 (where CPU kernels change most), then coarser; the edge interpolates between.
# On one CPU core the whole curve to 32 takes about 3 s for the embedded target.
SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)
BATCH_SESSIONS = (8, 64)  # B measured beside one session on a GPU (a CPU replica measures none)
PREFILL_SESSIONS = 8  # sessions whose contexts one prefill pass feeds while setting up a batch
RETRY_S = 1.0  # a background measurement that found sessions open (or no room) tries again this much later


def cost_sizes(max_tokens: int) -> tuple[int, ...]:
    """The pass sizes measured for a curve up to `max_tokens` (which is always among them)."""
    if max_tokens < 1:
        return ()
    return tuple(m for m in SIZES if m < max_tokens) + (max_tokens,)


class CurveMeasurement:
    """A replica's curves, measured a piece at a time on the thread that owns the engine. The pieces: a
    context of CONTEXT_TOKENS tokens cached, then `repeats` + 1 sweeps of one pass per size of
    `cost_sizes(max_tokens)` after it (sizes interleaved within a sweep, so that a slow moment of the
    machine spreads over all of them instead of bending the curve; the first sweep is a warm-up and
    not kept), then, if `batch_sessions` names any, the batch curves as one piece. `pause` gives the
    context back; the sweep under way then starts over, on a new context."""

    def __init__(self, engine: Engine, vocab_size: int, max_tokens: int, batch_sessions: Sequence[int] = (),
                 repeats: int = REPEATS) -> None:
        self.engine, self.vocab_size, self.max_tokens = engine, vocab_size, max_tokens
        self.sizes = cost_sizes(max_tokens)
        self.batch_sessions = tuple(batch_sessions)
        self._sweeps = repeats + 1 if self.sizes else 0
        self._swept = 0  # sweeps done
        self._sweep: list[float] = []  # the sweep under way: ms per size so far
        self._times: dict[int, list[float]] = {m: [] for m in self.sizes}
        self._batches: tuple[tuple[int, int, float], ...] | None = None if self.batch_sessions and self.sizes else ()
        self._kv = None  # the context, while held

    @property
    def done(self) -> bool:
        """Every piece ran."""
        return self._swept == self._sweeps and self._batches is not None

    @property
    def curves(self) -> tuple[tuple[tuple[int, float], ...], tuple[tuple[int, int, float], ...]]:
        """(M, ms: the fastest kept sweep) per size, and (B, M, ms) per batch size; () until done."""
        if not self.done:
            return (), ()
        return tuple((m, round(min(self._times[m]), 3)) for m in self.sizes), self._batches or ()

    def piece(self) -> bool:
        """Run the next piece (on the thread that owns the engine). False, having run nothing, when the
        cache has no room for the context now: try again later."""
        if self.done:
            return True
        if self._swept == self._sweeps:
            self._batches = measure_batch_costs(self.engine, self.vocab_size, self.max_tokens, self.batch_sessions,
                                                self._sweeps - 1)
            return True
        if self._kv is None:
            kv = self.engine.new_sequence()
            if not self.engine.fits(kv, CONTEXT_TOKENS + self.max_tokens):
                return False
            self._kv = kv
            self.engine.reserve(kv, CONTEXT_TOKENS)
            self.engine.forward([Feed(kv, _tokens(CONTEXT_TOKENS, self.vocab_size, 0), scored=False)])
            return True
        m = self.sizes[len(self._sweep)]
        elapsed, _ = time_pass(self.engine, self._kv, CONTEXT_TOKENS,
                               _tokens(m, self.vocab_size, CONTEXT_TOKENS + self._swept))
        self._sweep.append(elapsed)
        if len(self._sweep) == len(self.sizes):
            if self._swept:  # the first sweep warms the kernels up and is not kept
                for size, ms in zip(self.sizes, self._sweep):
                    self._times[size].append(ms)
            self._swept += 1
            self._sweep = []
            if self._swept == self._sweeps:
                self.pause()  # the sweeps are over: the context's room goes back
        return True

    def pause(self) -> None:
        """Give the context back (sessions need the room); the sweep under way starts over later."""
        if self._kv is not None:
            kv, self._kv = self._kv, None
            self.engine.release(kv)
        self._sweep = []

    def run(self) -> tuple[tuple[tuple[int, float], ...], tuple[tuple[int, int, float], ...]]:
        """Every piece now, back to back; the curves. ResourceExhausted if the cache has no room for them."""
        try:
            while not self.done:
                if not self.piece():
                    raise ResourceExhausted("the KV cache has no room to measure the pass-cost curve")
        finally:
            self.pause()
        return self.curves


def measure_in_background(measurement: CurveMeasurement, submit: Callable[[Callable[[], object]], Future],
                          done: Callable[[CurveMeasurement], None], idle: Callable[[], bool] = lambda: True) -> None:
    """Run `measurement` a piece at a time, each queued with `submit` (a Verifier's submit_call: it runs
    on the stepping thread, first in a step, before that step's pass), then `done(measurement)` there.
    While `idle()` (read there) is False, or a piece finds no room, the measurement pauses and tries
    again RETRY_S later; a piece that fails ends it (logged), as does a verifier that stops."""
    def step() -> None:
        try:
            ran = idle() and measurement.piece()
            if not ran:
                measurement.pause()
        except Exception:  # noqa: BLE001 — the replica serves on without a curve
            log.exception("measuring the pass-cost curve failed; edges size their blocks without it")
            measurement.pause()
            return
        if measurement.done:
            done(measurement)
        elif ran:
            queue()
        else:
            timer = threading.Timer(RETRY_S, queue)
            timer.daemon = True
            timer.start()

    def queue() -> None:
        try:
            submit(step)
        except Exception:  # noqa: BLE001 — the verifier is stopping: nothing to measure for
            pass

    queue()


def measure_pass_costs(engine: Engine, vocab_size: int, max_tokens: int,
                       repeats: int = REPEATS) -> tuple[tuple[int, float], ...]:
    """(M, milliseconds, the fastest of `repeats`) of a scored pass of M tokens after CONTEXT_TOKENS cached ones, for the
    sizes of `cost_sizes(max_tokens)`, measured now (`CurveMeasurement`). Leaves the engine as it was."""
    return CurveMeasurement(engine, vocab_size, max_tokens, repeats=repeats).run()[0]


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
