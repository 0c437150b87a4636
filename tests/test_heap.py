"""A serving process's garbage collector once started (cloud/core/heap.py), in a fresh interpreter so
that the test run's own collector is left as it was."""
import subprocess
import sys

from hybridspec.cloud.core.heap import YOUNG_COLLECTION_THRESHOLD

PROBE = """
import gc, weakref
from hybridspec.cloud.core.heap import settle_heap

class Node:
    pass

kept = [[i] for i in range(5000)]  # what start-up keeps
a, b = Node(), Node()
a.other, b.other = b, a  # start-up's garbage: a cycle only a collection frees
gone = weakref.ref(a)
del a, b
settle_heap()
print(gc.get_threshold()[0], gc.get_freeze_count(), gone() is None, gc.get_count()[0])
"""


def test_settling_collects_start_up_garbage_freezes_what_is_kept_and_collects_the_young_less_often():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    threshold, frozen, collected, young = out.stdout.split()
    assert int(threshold) == YOUNG_COLLECTION_THRESHOLD > 700  # CPython's default is 700
    assert int(frozen) >= 5000  # the kept lists (and everything else alive) are out of the collector's sight
    assert collected == "True"  # garbage was collected before the freeze, not frozen for good
    assert int(young) < 100  # nothing left pending in the youngest generation
