"""The garbage collector of a process that serves rounds: set once, when it has started."""
from __future__ import annotations

import gc

# CPython collects its youngest generation after every 700 more container objects made than freed.
# A step of 64 rounds makes them in bursts of more than that, so the model thread met about 0.8
# collections a step, each tracing the rounds in flight: about 0.2 ms a step (counted with gc.callbacks
# under bench/hop_overhead.py --host at 64 edges; docs/measurements.md). At ten thousand the bursts stay
# below the threshold and it met none in a 10 s window. What waits to be collected meanwhile is a few
# megabytes at most, and only reference cycles wait at all (the rest is freed when its last reference goes).
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
