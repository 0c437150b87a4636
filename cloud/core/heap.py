"""The garbage collector of a process that serves rounds: set once, when it has started."""
from __future__ import annotations

import gc

# CPython collects its youngest generation after every 700 more container objects made than freed.
# A step of 64 rounds makes and frees thousands, so it met about one collection a step, and each
# traced every round still in flight: a fifth of a millisecond of the model thread's time, about a
# tenth of its host work (bench/hop_overhead.py --host, docs/measurements.md). At ten thousand a
# collection comes about every dozen steps; what waits to be collected meanwhile is a few megabytes
# at most, and only reference cycles wait at all (the rest is freed when its last reference goes).
YOUNG_COLLECTION_THRESHOLD = 10_000


def settle_heap() -> None:
    """Once a serving process has loaded everything it keeps (torch, the model, gRPC: hundreds of
    thousands of objects): collect what start-up left over, freeze the rest out of the collector's sight
    (a full collection no longer scans it, holding every session's round meanwhile), and collect the
    youngest generation less often. Idempotent; each serving process calls it once it has started."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, older, oldest)
