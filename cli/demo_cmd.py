"""`hybridspec demo`: the embedded default pair end to end on this machine, and the edge's decision
with the numbers behind it (cli/demo_report.py): where drafting pays here, by how much it was predicted
to and did; where the edge chose cloud-only, why.

The verifier runs in its own process; where there are at least two cores, it and the edge are
pinned to different cores with one torch thread each, so they behave like two hosts.

The speed-up is measured fairly: both strategies are warmed up, then they take turns (the order
alternating), and the verdict is the 95 % interval of the per-turn ratios. The demo used to time one
run of each, the default edge first; on this 2-core box that put the default edge at 0.79-0.96x in
three fresh runs while the two decoded the same tokens the same way (92253c5:bench/demo_fairness.py,
a benchmark now in git history).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from rich.console import Console
from rich.table import Table

from ..edge.controller import DEFAULT_RATES
from ..lab.stats import LEVEL
from .demo_report import Outcome, Turns, explain

DEFAULT_PROMPT = "Write a short poem about the sea."
# How the demo keeps greedy text from looping, applied identically by drafter and verifier (flags override).
DEMO_TEXT = {"repetition_penalty": 1.15}
WARMUP_TOKENS = 32  # a short generation of each strategy first: timed runs see measured rates, not first calls
TURNS = 5  # timed turns; each runs the default edge and cloud-only once


def register(sub) -> None:
    """Add the `demo` command."""
    demo = sub.add_parser("demo", help="start a local verifier, run the edge on a chat prompt, show the result")
    demo.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message")
    demo.add_argument("--no-pin", action="store_true", help="do not pin edge and cloud to separate cores")
    demo.add_argument("--save", metavar="FILE", help="also write the turns' tokens/s and the interval to FILE (JSON)")
    demo.add_argument("--turns", type=_turns, default=TURNS,
                      help=f"timed turns, each running the default edge and cloud-only once (default {TURNS}; "
                           "the interval needs at least 2)")
    from .edge_options import add_edge_options

    add_edge_options(demo)
    demo.set_defaults(run=run_demo)


def _turns(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def run_demo(args) -> int:
    """Pull if needed, serve, warm up, time the default edge and cloud-only in turns, stop, report."""
    from ..cloud.process import start_cloud_process, stop_cloud_process
    from ..fetch import embedded
    from .edge_cmd import legend, prompt_ids, render_origins
    from .edge_options import build_worker, edge_config

    console = Console()
    if not embedded.is_pulled():
        console.print("[bold]pulling the embedded default models (one time)...[/]")
        embedded.pull(log=lambda msg: console.print(f"  {msg}"))
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    cores = sorted(os.sched_getaffinity(0))
    with console.status("starting the cloud side: a local Ray pool with one replica..."):
        server, address, _ = start_cloud_process({"torch_threads": 1} if pin else {}, {cores[1]} if pin else None)
    try:
        if pin:
            os.sched_setaffinity(0, {cores[0]})
        config = edge_config(args, cloud=address, max_new_tokens=96, torch_threads=1 if pin else 0, **DEMO_TEXT)
        baseline = config.updated(cloud_only=True)
        worker = build_worker(config)
        prompt = prompt_ids(worker.codec, args.prompt, chat=True)
        console.print(f"[bold]prompt:[/] {args.prompt}")
        # 1. Warm up both: the edge measures its drafter, the link and the cloud (as a long-lived edge
        #    has), and each strategy's first call is out of the way.
        with console.status("warming up: the edge measures its drafter, the link and the cloud..."):
            for warm in (config, baseline):
                worker.generate(prompt, warm.updated(max_new_tokens=WARMUP_TOKENS))
        # 2. Turns: each runs both strategies, the order alternating, so drift hits both alike.
        hybrid, cloud, shown, rates, checks = [], [], None, None, 0
        for turn in range(args.turns):
            order = ((config, hybrid), (baseline, cloud)) if turn % 2 == 0 else ((baseline, cloud), (config, hybrid))
            for cfg, runs in order:
                what = "cloud-only (the target decodes alone)" if cfg.policy.cloud_only else "the default edge"
                with console.status(f"turn {turn + 1} of {args.turns}: {what}..."):
                    runs.append(worker.generate(prompt, cfg))
                if shown is None and runs is hybrid:
                    shown = runs[0]  # what the edge decided on, before later runs add to it
                    rates, checks = worker.estimates.rates(DEFAULT_RATES), worker.estimates.checked[0]
        worker.close()
    finally:
        stop_cloud_process(server)
    # 3. The first timed generation of the default edge, and the comparison over every turn.
    console.print(legend())
    console.print(render_origins(worker.codec, shown.token_ids, shown.origins))
    turns = Turns(tuple(g.stats.tokens_per_s for g in hybrid), tuple(g.stats.tokens_per_s for g in cloud))
    same = all(g.token_ids == shown.token_ids for g in hybrid + cloud)
    console.print(_table(worker, shown.stats, turns, same, pin))
    outcome = Outcome(sum(g.stats.rounds for g in hybrid), sum(g.stats.drafted for g in hybrid),
                      sum(g.stats.accepted for g in hybrid), turns, checks)
    for line in explain(worker.info, rates, worker.cap, config.policy.pipeline, outcome):
        console.print(line)
    if args.save:
        _save(args.save, turns, outcome, same, pin)
    return 0


def _save(path: str, turns: Turns, outcome: Outcome, same: bool, pin: bool) -> None:
    """The measured comparison as JSON (92253c5:bench/demo_runs.py collected fresh demos' files)."""
    est = turns.speedup()
    record = {"turns": len(turns.hybrid_tokens_per_s), "pinned": pin, "same_tokens": same,
              "default_edge_tokens_per_s": list(turns.hybrid_tokens_per_s),
              "cloud_only_tokens_per_s": list(turns.cloud_tokens_per_s),
              "speedup": {"mean": est.value, "lo": est.lo, "hi": est.hi, "level": LEVEL},
              "rounds": outcome.rounds, "drafted": outcome.drafted, "accepted": outcome.accepted}
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def _table(worker, s, turns: Turns, same: bool, pin: bool) -> Table:
    """The first timed generation's statistics, and both strategies' mean tokens/s over the turns."""
    table = Table(title="edge-cloud speculative decoding: the default edge's first timed generation "
                        f"({'pinned to separate cores' if pin else 'unpinned'})")
    table.add_column("stat")
    table.add_column("value", justify="right")
    kind = "eagle head (target features)" if worker.drafter_model.is_eagle else "plain"
    n = len(turns.hybrid_tokens_per_s)
    rows = [("drafter", kind), ("new tokens", s.new_tokens), ("rounds", s.rounds), ("drafted", s.drafted), ("accepted", s.accepted),
            ("acceptance rate", f"{s.acceptance_rate:.3f}"), ("tokens per round", f"{s.mean_tokens_per_round:.2f}"),
            ("fallbacks (BiLD α_FB)", s.fallbacks), ("mean block length γ (adaptive)", f"{s.mean_gamma:.2f}"),
            ("blocks drafted ahead and used (pipelining)", s.pipeline_hits),
            ("tokens decoded by the cloud alone", s.cloud_only_tokens),
            ("switches to cloud-only / back", f"{s.switches_to_cloud} / {s.switches_to_hybrid}"),
            ("uplink bytes", s.uplink_bytes),
            ("downlink bytes", s.downlink_bytes), ("of which target features", s.feature_bytes), ("bytes per token", f"{s.bytes_per_token:.1f}"),
            ("wall s", f"{s.wall_s:.2f}"),
            (f"tokens/s (default edge), mean of {n} turns", f"{statistics.fmean(turns.hybrid_tokens_per_s):.1f}"),
            (f"tokens/s (cloud-only), mean of {n} turns", f"{statistics.fmean(turns.cloud_tokens_per_s):.1f}"),
            ("same tokens as cloud-only, every turn", "yes" if same else "no")]
    for name, value in rows:
        table.add_row(name, str(value))
    return table
