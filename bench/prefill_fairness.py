"""How long one long prompt makes everybody else wait, by prefill budget.

    python bench/prefill_fairness.py [--prompt-tokens 4000] [--budgets-ms 50 100 200] [--out FILE.jsonl]

One verifier core driven by its scheduler, as a replica runs it (embedded target, one torch thread;
pin it with `taskset -c N`). A victim session sends rounds of γ = 4 drafts back to back; its round
latency is measured alone, then while another client opens a session with a long prompt. Reported
per budget: the prefill's total time and the victim's round latency during it (p50, p90, max)
against its latency alone. The victim sends its next round the moment a reply arrives, the worst
case for both sides: a real edge drafts between rounds, and the prompt advances in those gaps.
"""
from __future__ import annotations

import json
import asyncio
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.loading import load_model
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec
from harness import arguments, median, percentile

VICTIM_PROMPT = tuple(range(1000, 1200))  # 200 tokens of context
DRAFT = (30, 31, 32, 33)


def victim_rounds(verifier: Verifier, state: dict, until) -> list[float]:
    """Rounds of the victim session, back to back, until `until()`; their latencies in ms."""
    latencies = []
    while not until():
        t0 = time.perf_counter()
        result = verifier.submit_round(DraftBlock("victim", state["round"], state["length"], DRAFT)).result(600)
        latencies.append(1e3 * (time.perf_counter() - t0))
        state["round"] += 1
        state["length"] = result.committed_len
    return latencies


def measure(target, prompt_tokens: int, budget_ms: float) -> dict:
    verifier = Verifier(target, VerifierLimits(max_context=prompt_tokens + 4096, prefill_chunk=128),
                        prefill_budget_ms=budget_ms)
    asyncio.run(verifier.start())  # the model thread, as a replica serves
    try:
        verifier.submit_open(SessionSpec("victim", VICTIM_PROMPT)).result(600)
        state = {"round": 0, "length": len(VICTIM_PROMPT)}
        deadline = time.perf_counter() + 3.0
        alone = victim_rounds(verifier, state, lambda: time.perf_counter() > deadline)
        t0 = time.perf_counter()
        long_open = verifier.submit_open(SessionSpec("long", tuple(4 + i % 40000 for i in range(prompt_tokens))))
        during = victim_rounds(verifier, state, long_open.done)
        long_open.result()
        prefill_s = time.perf_counter() - t0
    finally:
        asyncio.run(verifier.stop())

    def stats(xs: list[float]) -> dict:
        return {"p50": round(median(xs), 1), "p90": round(percentile(xs, 90), 1), "max": round(max(xs), 1)}

    return {"prefill_budget_ms": budget_ms, "prompt_tokens": prompt_tokens, "prefill_s": round(prefill_s, 2), "victim_rounds_during": len(during),
            "victim_alone_ms": stats(alone), "victim_during_ms": stats(during)}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--budgets-ms", type=float, nargs="+", default=[30.0, 60.0, 120.0])
    parser.add_argument("--out", type=Path, help="append the rows (JSON lines) to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_model(default_paths()["target"], device="cpu")
    for budget in args.budgets_ms:
        row = measure(target, args.prompt_tokens, budget)
        print(json.dumps(row), flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
