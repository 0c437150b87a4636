"""How long one long prompt makes everybody else wait, by prefill chunk size.

    python bench/prefill_fairness.py [--prompt-tokens 4000] [--chunks 64 128 256 4096]

One verifier core (embedded target, one torch thread, as a replica runs it). A client opens a
session with a long prompt; meanwhile another session sends empty rounds (one cloud-only token
each) back to back. Reported per chunk size: the prefill's total time, and the other session's
round latency while the prefill runs (median and worst). A chunk as long as the prompt is the old
behaviour: the prefill holds the model from start to end.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridspec.cloud.verifier import Verifier, VerifierLimits
from hybridspec.common.embedded import default_paths
from hybridspec.common.models import load_model
from hybridspec.common.wire import DraftBlock, SessionSpec


def measure(target, prompt_tokens: int, chunk: int) -> dict:
    verifier = Verifier(target, VerifierLimits(max_context=prompt_tokens + 64, prefill_chunk=chunk))
    verifier.open_session(SessionSpec("short", (1, 2, 3)))
    verifier.verify(DraftBlock("short", 0, 3, ()))  # warm
    latencies: list[float] = []
    done = threading.Event()
    spent = {}

    def long_open() -> None:
        t0 = time.perf_counter()
        verifier.open_session(SessionSpec("long", tuple(range(100, 100 + prompt_tokens))))
        spent["prefill_s"] = time.perf_counter() - t0
        done.set()

    opener = threading.Thread(target=long_open)
    opener.start()
    length, r = 4, 1
    while not done.is_set():
        t0 = time.perf_counter()
        length = verifier.verify(DraftBlock("short", r, length, ())).committed_len
        latencies.append(time.perf_counter() - t0)
        r += 1
    opener.join()
    return {"chunk": chunk, "prefill_s": round(spent["prefill_s"], 2), "rounds_during_prefill": len(latencies),
            "round_ms_median": round(1e3 * statistics.median(latencies), 1),
            "round_ms_worst": round(1e3 * max(latencies), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256, 4096])
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_model(default_paths()["target"], device="cpu")
    for chunk in args.chunks:
        print(json.dumps(measure(target, args.prompt_tokens, chunk)), flush=True)


if __name__ == "__main__":
    main()
