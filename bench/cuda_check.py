"""Checks the CUDA path: edge drafter and verifier core on a GPU, greedy, against the target alone.

    python bench/cuda_check.py [--target DIR] [--drafter DIR] [--device cuda]

For block lengths 1..8 it runs the edge's draft → verify → commit loop in-process (the co-located
baseline of lab/baselines.py: ModelDrafter and Verifier, what the edge worker and a replica run,
without the network) and compares the
output with the target's own `generate(do_sample=False)` on the same device and dtype. In fp32 the
two must be identical; in bf16/fp16 a block's one forward pass and generate's token-by-token passes
round differently, so a near-tie can flip and the outputs may part ways there: the script reports
how many tokens agree before the first difference, and the speed of both.
"""
from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.loading import load_model
from hybridspec.distill.prompts import FREEFORM_PROMPTS
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.prompt import encode_prompt
from hybridspec.lab.baselines import colocated
from harness import arguments


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--target", default=str(default_paths()["target"]))
    parser.add_argument("--drafter", default=str(default_paths()["drafter"]))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    target = load_model(args.target, args.device, args.dtype)
    drafter_model = load_model(args.drafter, args.device, args.dtype)
    print(f"device {target.device}, target dtype {target.model.dtype}, drafter dtype {drafter_model.model.dtype}")
    verifier = Verifier(target, VerifierLimits(max_context=2048))
    prompts = [encode_prompt(target.tokenizer, p, chat=True) for p in FREEFORM_PROMPTS[:4]]
    refs, ref_s = [], 0.0
    for p in prompts:
        t0 = time.perf_counter()
        ids = torch.tensor([p], device=target.device)
        out = target.model.generate(ids, do_sample=False, max_new_tokens=args.new_tokens,
                                    attention_mask=torch.ones_like(ids))
        ref_s += time.perf_counter() - t0
        refs.append(out[0, len(p):].tolist())
    print(f"target alone: {sum(map(len, refs)) / ref_s:.1f} tokens/s")
    for gamma in range(1, 9):
        config = EdgeConfig.of(max_new_tokens=args.new_tokens, max_draft=gamma, fallback_threshold=0.0, wire_top_k=0)
        agree = total = generated = rounds = 0
        spent = 0.0
        for p, ref in zip(prompts, refs):
            run = colocated(verifier, drafter_model, p, config)
            agree += next((j for j, (a, b) in enumerate(zip(run.tokens, ref)) if a != b), min(len(ref), len(run.tokens)))
            total += len(ref)
            generated += len(run.tokens)
            rounds += run.stats["rounds"]
            spent += run.wall_s
        print(f"γ={gamma}: {agree}/{total} tokens identical to generate() before the first difference, "
              f"{generated / rounds:.2f} tokens/round, {generated / spent:.1f} tokens/s")


if __name__ == "__main__":
    main()
