"""`hybridspec distill`: train a compact drafter aligned to a target."""
from __future__ import annotations

import json


def register(sub) -> None:
    """Add the `distill` command."""
    d = sub.add_parser("distill", help="distil a small drafter from a target model")
    d.add_argument("--target", required=True, help="target model directory, .gguf file or cached hub id")
    d.add_argument("--out", required=True, help="directory for the compact drafter and its report")
    d.add_argument("--config", help="YAML file of DistillConfig keys")
    d.add_argument("--kind", choices=["model", "eagle"],
                   help="model: a small causal LM (default); eagle: a head drafting from the target's features")
    d.add_argument("--layers", type=int, help="drafter decoder layers, model kind (default 2)")
    d.add_argument("--steps", type=int, help="optimiser steps (default 400)")
    d.add_argument("--head-size", type=int, help="vocabulary rows the drafter predicts over (default 8192; 0 = all)")
    src = d.add_mutually_exclusive_group()
    src.add_argument("--data", help="a corpus or a train-samples.jsonl from an earlier run, instead of generating")
    src.add_argument("--generate", type=int, help="training responses the target generates (default 480)")
    d.add_argument("--max-new-tokens", type=int, help="length of each generated response (default 128)")
    d.add_argument("--temperature", type=float, help="target sampling temperature for generated data (default 0)")
    d.add_argument("--temperatures", help='several temperatures, comma-separated (e.g. "0,0.7"): prompts split evenly')
    d.add_argument("--self-instruct", type=int, help="extra prompts the target writes itself, then answers (default 0)")
    d.add_argument("--unroll", type=int, help="eagle: passes feeding the head its own features (default 2)")
    d.add_argument("--init", help="eagle: a plain compact drafter to start from (default: from scratch)")
    d.add_argument("--feature-loss", type=float, help="eagle: weight of feature regression next to the KL (default 1)")
    d.add_argument("--gen-batch-size", type=int, help="prompts per batched target generation (default 16)")
    d.add_argument("--batch-tokens", type=int, help="tokens per optimiser step (default 2048)")
    d.add_argument("--lr", type=float, help="peak learning rate (default 1e-3)")
    d.add_argument("--eval-every", type=int, help="steps between held-out evaluations (default 50)")
    d.add_argument("--heldout", type=int, help="held-out prompts to evaluate on (default 24)")
    d.add_argument("--seed", type=int, help="seed for data, initialisation order and batches")
    d.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    d.add_argument("--store", choices=["float16", "int8"], help="weight storage (default float16; int8 halves it)")
    d.add_argument("--base", help='how the drafter refers to its target (default: its absolute path; "embedded:target")')
    d.set_defaults(run=run_distill)


def run_distill(args) -> int:
    """Distil, then print the final held-out numbers."""
    from ..common.config import load_config
    from ..distill.train import DistillConfig, distill

    keys = ["target", "out", "kind", "temperatures", "self_instruct", "unroll", "init", "feature_loss", "layers", "steps", "head_size", "data", "generate", "max_new_tokens", "temperature",
            "gen_batch_size", "batch_tokens", "lr", "eval_every", "heldout", "seed", "device", "base", "store"]
    overrides = {k: getattr(args, k) for k in keys}
    if args.data is not None:
        overrides["generate"] = 0
    report = distill(load_config(DistillConfig, args.config, overrides))
    final = report["final"]
    print(json.dumps({"out": args.out, "agreement": round(final["agreement"], 4),
                      "acceptance": final["acceptance"], "tokens_per_round": final["tokens_per_round"],
                      "train_s": round(report["train_s"], 1)}))
    return 0
