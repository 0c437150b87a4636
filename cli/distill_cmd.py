"""`hybridspec distill`: train a compact drafter aligned to a target."""
from __future__ import annotations

import json

from ..common.config import load_config
from ..distill.config import DistillConfig
from .flags import add_config_flags, config_overrides


def register(sub) -> None:
    """Add the `distill` command."""
    d = sub.add_parser("distill", help="distil a small drafter from a target model",
                       description="--target and --out are required; with --data and no --generate, the "
                                   "drafter learns from the corpus alone.")
    d.add_argument("--config", help="YAML file of DistillConfig keys; flags override it")
    add_config_flags(d.add_argument_group("settings (DistillConfig keys)"), DistillConfig)
    d.set_defaults(run=run_distill)


def run_distill(args) -> int:
    """Distil, then print the final held-out numbers."""
    from ..distill.train import distill

    overrides = config_overrides(args, DistillConfig)
    if "data" in overrides and "generate" not in overrides:
        overrides["generate"] = 0
    config = load_config(DistillConfig, args.config, overrides)
    report = distill(config)
    final = report["final"]
    print(json.dumps({"out": config.out, "agreement": round(final["agreement"], 4),
                      "acceptance": final["acceptance"], "tokens_per_round": final["tokens_per_round"],
                      "train_s": round(report["train_s"], 1)}))
    return 0
