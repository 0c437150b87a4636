"""A real drafter's acceptance, as a trace the GPU suite replays: for the shipped pair (the embedded
SmolLM2 target and its distilled drafter), whether the drafter's greedy choice equals the target's
token at every position of the target's own greedy answers to held-out prompts.

    python bench/acceptance_trace.py --out docs/engine/acceptance-trace-smollm2.json

In greedy decoding a drafted token is accepted iff it is the target's argmax, and while every draft
so far was accepted the drafter's context is the target's, so these flags replay speculative rounds
exactly (distill/evaluate.py): a round at position s with γ drafts accepts the run of agreements
from s, at most γ. The capacity part of the GPU suite (lab/gpu_suite/capacity.py) drafts from the
flags instead of a constant α, so a GPU run sees this drafter's acceptance by position, runs of
agreement included, without the drafter or a tokenizer on the device. Written: the flags (one string
of 0/1 per answer), α per position for γ = 4 and 8, and where and when they were recorded.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.loading import load_model
from hybridspec.distill.data import generate_samples
from hybridspec.distill.evaluate import agreement_flags, replay
from hybridspec.distill.prompts import heldout_prompts
from harness import arguments, commit, write_json


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts answered")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    paths = default_paths()
    began = time.perf_counter()
    target = load_model(str(paths["target"]), device="cpu")
    drafter = load_model(str(paths["drafter"]), device="cpu")
    # Seed 7: the held-out task/topic draws bench/drafter_quality.py reports on.
    samples = generate_samples(target, heldout_prompts(args.prompts, seed=7), args.new_tokens, 0.0, 8, 1,
                               "target's greedy answers")
    flags = agreement_flags(drafter.model, drafter.head_ids, samples, drafter.device)
    positions = {}
    for gamma in (4, 8):
        rounds, drafted, accepted, tries, hits = replay(flags, gamma)
        positions[str(gamma)] = {"alpha_by_position": [round(h / t, 4) if t else None for h, t in zip(hits, tries)],
                                 "accepted_per_drafted": round(accepted / max(drafted, 1), 4),
                                 "tokens_per_round": round(sum(map(len, flags)) / max(rounds, 1), 4)}
    total = sum(map(len, flags))
    write_json(args.out, {
        "what": "drafter-agrees-with-target flags over the target's greedy answers (1 = the drafter's argmax "
                "is the target's token at that position)",
        "target": paths["target"].name, "drafter": paths["drafter"].name, "prompts": args.prompts,
        "new_tokens": args.new_tokens, "tokens": total, "agreement": round(sum(map(sum, flags)) / max(total, 1), 4),
        "by_gamma": positions, "flags": ["".join("1" if f else "0" for f in row) for row in flags],
        "date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": "this repository's CPU machine, "
        f"{args.threads} torch thread(s)", "seconds": round(time.perf_counter() - began, 1),
        "command": f"python bench/acceptance_trace.py --out {args.out}"})


if __name__ == "__main__":
    main()
