"""Part (a): the time of one pass of B sessions × M tokens each over a cached context, on an engine,
and v = t(5) / t(1): what a block of four drafts plus the newest token costs in one-token passes."""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch

from ...cloud.engine.base import Engine, Feed


def _sync(engine: Engine) -> None:
    if engine.capabilities.device.startswith("cuda"):
        torch.cuda.synchronize()


def prefill(engine: Engine, sessions: int, context: int, vocab: int, chunk: int = 512) -> list:
    """`sessions` sequences with `context` random tokens cached each."""
    rng = random.Random(0)
    kvs = []
    for _ in range(sessions):
        kv = engine.new_sequence()
        engine.reserve(kv, context)
        ids = [rng.randrange(vocab) for _ in range(context)]
        for start in range(0, context, chunk):
            engine.forward([Feed(kv, ids[start:start + chunk], scored=False)])
        kvs.append(kv)
    return kvs


def time_passes(engine: Engine, vocab: int, batches: list[int], tokens: list[int], context: int, repeats: int,
                progress: Callable[[str], None] = print) -> list[dict]:
    """Median wall time (ms, host work and device sync included: what a step costs a replica) of a
    scored pass of B sessions × M tokens each after `context` cached tokens, for every B and M."""
    rng = random.Random(1)
    rows = []
    kvs = prefill(engine, max(batches), context, vocab)
    for b in batches:
        for m in tokens:
            samples = []
            for r in range(repeats + 2):  # two warm-ups
                feeds = [Feed(kv, [rng.randrange(vocab) for _ in range(m)], scored=True) for kv in kvs[:b]]
                for kv in kvs[:b]:
                    engine.reserve(kv, m)
                _sync(engine)
                start = time.perf_counter()
                engine.forward(feeds)
                _sync(engine)
                if r >= 2:
                    samples.append((time.perf_counter() - start) * 1e3)
                for kv in kvs[:b]:
                    engine.truncate(kv, context)
            rows.append({"sessions": b, "tokens": m, "ms": statistics.median(samples),
                         "ms_min": min(samples), "ms_max": max(samples), "repeats": repeats})
        progress(f"  B={b}: " + ", ".join(f"M={r['tokens']} {r['ms']:.2f} ms" for r in rows if r["sessions"] == b))
    for kv in kvs:
        engine.release(kv)
    return rows
