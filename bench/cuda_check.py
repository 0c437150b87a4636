"""Checks the CUDA path: edge drafter and verifier core on a GPU, greedy, against the target alone.

    python bench/cuda_check.py [--target DIR] [--drafter DIR] [--device cuda]

For block lengths 1..8 it runs the edge's draft → verify → commit loop in-process (ModelDrafter and
Verifier, exactly what the edge worker and a replica run, without the network) and compares the
output with the target's own `generate(do_sample=False)` on the same device and dtype. In fp32 the
two must be identical; in bf16/fp16 a block's one forward pass and generate's token-by-token passes
round differently, so a near-tie can flip and the outputs may part ways there: the script reports
how many tokens agree before the first difference, and the speed of both.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridspec.cloud.verifier import Verifier, VerifierLimits
from hybridspec.common.embedded import default_paths
from hybridspec.common.models import load_model
from hybridspec.common.wire import DraftBlock, SamplingParams, SessionSpec
from hybridspec.distill.prompts import FREEFORM_PROMPTS
from hybridspec.edge.drafter import ModelDrafter
from hybridspec.edge.prompt import encode_prompt


def speculative(verifier: Verifier, drafter: ModelDrafter, prompt: list[int], gamma: int, new: int, sid: str):
    """The edge loop without the network: (generated tokens, rounds)."""
    verifier.open_session(SessionSpec(sid, tuple(prompt)))
    committed, rounds = list(prompt), 0
    while len(committed) - len(prompt) < new:
        budget = min(gamma, new - (len(committed) - len(prompt)) - 1)
        proposal = drafter.propose(committed, budget, 0.0, frozenset())
        result = verifier.verify(DraftBlock(sid, rounds, len(committed), tuple(proposal.ids)))
        committed += [*proposal.ids[:result.num_accepted], result.next_token]
        rounds += 1
    verifier.close_session(sid)
    return committed[len(prompt):], rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
        out = target.model.generate(torch.tensor([p], device=target.device), do_sample=False,
                                    max_new_tokens=args.new_tokens, attention_mask=torch.ones(1, len(p), dtype=torch.long, device=target.device))
        ref_s += time.perf_counter() - t0
        refs.append(out[0, len(p):].tolist())
    print(f"target alone: {sum(map(len, refs)) / ref_s:.1f} tokens/s")
    for gamma in range(1, 9):
        agree, total, rounds, spent = 0, 0, 0, 0.0
        for i, (p, ref) in enumerate(zip(prompts, refs)):
            drafter = ModelDrafter(drafter_model, SamplingParams(), target.vocab_size, 0, None)
            t0 = time.perf_counter()
            got, r = speculative(verifier, drafter, p, gamma, args.new_tokens, f"g{gamma}-{i}")
            spent += time.perf_counter() - t0
            rounds += r
            agree += next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
            total += len(ref)
        print(f"γ={gamma}: {agree}/{total} tokens identical to generate() before the first difference, "
              f"{args.new_tokens * len(prompts) / rounds:.2f} tokens/round, "
              f"{args.new_tokens * len(prompts) / spent:.1f} tokens/s")


if __name__ == "__main__":
    main()
