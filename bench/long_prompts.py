"""Long conversations through the default pool: prompts of about 2,300 and 3,500 tokens (a system prompt
and earlier turns, bench/conversations.py), the default edge against `--cloud-only` and against hybrid
rounds that are always sent, in one run. Before the KV streams were resized every such prompt was
refused ("exceeds max_context 1024"); the figure is that each completes with identical tokens.

    python bench/long_prompts.py [--lengths 2300 3500] [--new-tokens 48] [--out FILE]

`cloud serve` with its defaults (a Ray pool of one replica, llama.cpp, max_context 4,096) on core 1, the
edges in this process on core 0, greedy. Each length is decoded by `--cloud-only` first (it pays the
prefill), then by the default edge and by hybrid rounds of γ = 4 never switching to cloud-only (both
start from the replica's cached prefix of the conversation); every edge's tokens must equal the first's.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hybridspec.cloud.process import start_cloud_process, stop_cloud_process
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.gguf import served_weights
from hybridspec.common.models.loading import load_model
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.state import EventKind
from hybridspec.edge.worker import EdgeWorker
from conversations import long_conversation
from harness import CLOUD_CORE, EDGE_CORE, header, pin, write_json

STRATEGIES = {"cloud-only": {"cloud_only": True}, "default-edge": {},
              "hybrid-g4": {"cloud_only_switch": False, "gamma_policy": "fixed", "max_draft": 4, "tree_nodes": 0}}


def generate(drafter, address: str, prompt: list[int], new_tokens: int, settings: dict) -> dict:
    """One generation by a fresh edge worker: its tokens, time to first token and wall time."""
    config = EdgeConfig(cloud=address, max_new_tokens=new_tokens, timeout_s=300, **settings)
    with VerifierClient(address, timeout_s=config.timeout_s) as client:
        worker = EdgeWorker(drafter, client, config)
        start, first = time.perf_counter(), None
        run = worker.stream(prompt)
        for event in run:
            if first is None and event.kind is EventKind.COMMIT and event.tokens:
                first = time.perf_counter() - start
        gen = run.generation
    return {"tokens": gen.token_ids, "ttft_s": round(first or 0.0, 2), "wall_s": round(gen.stats.wall_s, 2),
            "rounds": gen.stats.rounds, "cloud_only_tokens": gen.stats.cloud_only_tokens, "error": gen.error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2300, 3500])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    pin(EDGE_CORE)
    paths = default_paths()
    drafter = load_model(paths["drafter"], device="cpu")
    proc, address, _ = start_cloud_process({}, cores={CLOUD_CORE})
    rows = []
    try:
        for length in args.lengths:
            prompt = long_conversation(drafter.tokenizer, length, "Thank you. Which of these should I read first?")
            runs = {name: generate(drafter, address, prompt, args.new_tokens, settings)
                    for name, settings in STRATEGIES.items()}
            reference = runs["cloud-only"]["tokens"]
            rows.append({"prompt_tokens": len(prompt), "strategies": {
                name: {**{k: v for k, v in r.items() if k != "tokens"}, "new_tokens": len(r["tokens"]),
                       "same_tokens_as_cloud_only": r["tokens"] == reference} for name, r in runs.items()}})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        stop_cloud_process(proc)
    result = {**header(weights=served_weights(paths["target"])),
              "pool": "cloud serve defaults (Ray, one replica, llama.cpp, 1 thread, max_context 4096) on core 1",
              "new_tokens": args.new_tokens, "lengths": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
