"""Parking a session in host memory and restoring it, on the llama.cpp engine: what a swap costs, and that
the session decodes the same tokens afterwards.

    taskset -c 1 python bench/llamacpp_swap.py [--lengths 200 1000 4090] [--repeats 5] [--out FILE]

One stream of 4,096 cells (the serving default's size) and host memory for one parked session. Per
length: a conversation of that many tokens (bench/conversations.py) is prefilled and decodes 16 tokens
greedily (the reference); then, `--repeats` times, a second session takes the stream, which parks the
first (`llama_state_seq_get_data` into host memory), and the first runs again, which parks the second
and restores it (`set_data`). Park and restore are timed apart (the median is reported), and the
restored session decodes its 16 tokens again: they must equal the reference, and the logits of its
first token must be bit for bit those before parking.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from hybridspec.cloud.engine.base import Feed
from hybridspec.cloud.engine.llamacpp_engine import LlamaCppEngine
from hybridspec.cloud.core.limits import VerifierLimits
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.gguf import GgufTarget, find_gguf, served_weights
from conversations import long_conversation
from harness import header, median, write_json

DECODED = 16


def prefill(engine: LlamaCppEngine, kv, tokens: list[int]) -> None:
    for start in range(0, len(tokens), 512):
        engine.reserve(kv, len(tokens[start:start + 512]))
        engine.forward([Feed(kv, tokens[start:start + 512], scored=False)])


def decode(engine: LlamaCppEngine, kv, last: int) -> tuple[list[int], torch.Tensor]:
    """16 greedy tokens after `kv`'s cache and `last`, then cut back; and the first token's logits."""
    length, out, first = kv.length, [], None
    for _ in range(DECODED):
        engine.reserve(kv, 1)
        logits = engine.forward([Feed(kv, [out[-1] if out else last], scored=True)])[0].logits[-1]
        first = logits if first is None else first
        out.append(int(np.argmax(logits.numpy())))
    engine.truncate(kv, length)
    return out, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[200, 1000, 4090])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    target = default_paths()["target"]
    gguf = find_gguf(target)
    engine = LlamaCppEngine.serving(gguf, VerifierLimits(max_context=4096, kv_streams=1, max_sessions=2,
                                                         kv_cache_tokens=8192, max_tree_nodes=0), 1)
    tokenizer = GgufTarget(str(target), gguf, engine.vocab_size).tokenizer
    rows = []
    for length in args.lengths:
        conversation = long_conversation(tokenizer, length, "Thank you. What should I read next?")
        session, other = engine.new_sequence(), engine.new_sequence()
        prefill(engine, session, conversation[:-1])
        reference, logits = decode(engine, session, conversation[-1])
        park_ms, restore_ms, same, state_bytes = [], [], [], 0
        for _ in range(args.repeats):
            start = time.perf_counter()
            engine.reserve(other, 1)  # takes the only stream: `session` is parked
            park_ms.append((time.perf_counter() - start) * 1e3)
            assert session.seq_id is None and engine.parked_tokens == session.length
            state_bytes = len(session.parked)
            engine.forward([Feed(other, [conversation[0]], scored=False)])
            start = time.perf_counter()
            engine.reserve(session, 1)  # back into the stream: `other` (1 token) is parked, `session` restored
            restore_ms.append((time.perf_counter() - start) * 1e3)
            engine.truncate(session, session.length)
            tokens, first = decode(engine, session, conversation[-1])
            same.append(tokens == reference and torch.equal(first, logits))
            engine.release(other)
        row = {"tokens": session.length, "state_mb": round(state_bytes / 2**20, 1),
               "bytes_per_token": round(state_bytes / session.length),
               "park_ms": round(median(park_ms), 2), "restore_ms": round(median(restore_ms), 2),
               "park_ms_all": [round(x, 2) for x in park_ms], "restore_ms_all": [round(x, 2) for x in restore_ms],
               "identical_after_restore": f"{sum(same)} of {len(same)}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        engine.release(session)
    result = {**header(weights=served_weights(target)),
              "engine": "llamacpp, 1 thread, a stream of 4,096 cells", "decoded_tokens": DECODED, "sessions": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
