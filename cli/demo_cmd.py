"""`hybridspec demo`: the embedded default pair end to end on this machine, and the edge's decision
with the numbers behind it (cli/demo_report.py): where drafting pays here, by how much it was predicted
to and did; where the edge chose cloud-only, why.

The verifier runs in its own process; where there are at least two cores, it and the edge are
pinned to different cores with one torch thread each, so they behave like two hosts.
"""
from __future__ import annotations

import os
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from ..edge.controller import DEFAULT_RATES
from .demo_report import Outcome, explain

DEFAULT_PROMPT = "Write a short poem about the sea."
# How the demo keeps greedy text from looping, applied identically by drafter and verifier (flags override).
DEMO_TEXT = {"repetition_penalty": 1.15}
WARMUP_TOKENS = 32  # one short generation first, so the timed one runs on measured rates, not first-call costs


def register(sub) -> None:
    """Add the `demo` command."""
    demo = sub.add_parser("demo", help="start a local verifier, run the edge on a chat prompt, show the result")
    demo.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message")
    demo.add_argument("--no-pin", action="store_true", help="do not pin edge and cloud to separate cores")
    from .edge_options import add_edge_options

    add_edge_options(demo)
    demo.set_defaults(run=run_demo)


def run_demo(args) -> int:
    """Pull if needed, serve, generate, compare with cloud-only decoding, stop."""
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
        worker = build_worker(config)
        prompt = prompt_ids(worker.codec, args.prompt, chat=True)
        console.print(f"[bold]prompt:[/] {args.prompt}")
        with console.status("warming up: the edge measures its drafter, the link and the cloud..."):
            worker.generate(prompt, replace(config, max_new_tokens=WARMUP_TOKENS))  # as a long-lived edge has
        with console.status("edge drafting, cloud verifying..."):
            gen = worker.generate(prompt)
        rates = worker.estimates.rates(DEFAULT_RATES)  # what the edge decided on, before the baseline adds to it
        checks = worker.estimates.checked[0]
        console.print(legend())
        console.print(render_origins(worker.codec, gen.token_ids, gen.origins))
        with console.status("cloud-only baseline (target decodes alone, same settings)..."):
            baseline = worker.generate(prompt, replace(config, cloud_only=True))
        worker.close()
    finally:
        stop_cloud_process(server)
    s = gen.stats
    table = Table(title=f"edge-cloud speculative decoding ({'pinned to separate cores' if pin else 'unpinned'})")
    table.add_column("stat")
    table.add_column("value", justify="right")
    kind = "eagle head (target features)" if worker.drafter_model.is_eagle else "plain"
    rows = [("drafter", kind), ("new tokens", s.new_tokens), ("rounds", s.rounds), ("drafted", s.drafted), ("accepted", s.accepted),
            ("acceptance rate", f"{s.acceptance_rate:.3f}"), ("tokens per round", f"{s.mean_tokens_per_round:.2f}"),
            ("fallbacks (BiLD α_FB)", s.fallbacks), ("mean block length γ (adaptive)", f"{s.mean_gamma:.2f}"),
            ("blocks drafted ahead and used (pipelining)", s.pipeline_hits),
            ("tokens decoded by the cloud alone", s.cloud_only_tokens),
            ("switches to cloud-only / back", f"{s.switches_to_cloud} / {s.switches_to_hybrid}"),
            ("uplink bytes", s.uplink_bytes),
            ("downlink bytes", s.downlink_bytes), ("of which target features", s.feature_bytes), ("bytes per token", f"{s.bytes_per_token:.1f}"),
            ("wall s", f"{s.wall_s:.2f}"), ("tokens/s (default edge)", f"{s.tokens_per_s:.1f}"),
            ("tokens/s (cloud-only)", f"{baseline.stats.tokens_per_s:.1f}"),
            ("same tokens as cloud-only", "yes" if baseline.token_ids == gen.token_ids else "no")]
    for name, value in rows:
        table.add_row(name, str(value))
    console.print(table)
    outcome = Outcome(s.rounds, s.drafted, s.accepted, s.tokens_per_s, baseline.stats.tokens_per_s, checks)
    for line in explain(worker.info, rates, worker.cap, config.pipeline, outcome):
        console.print(line)
    return 0
