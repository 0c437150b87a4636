"""`hybridspec pair check`: whether a drafter fits a target, and whether the pair pays here and on a GPU."""
from __future__ import annotations

import json

from ..common.config import load_config
from ..lab.pairs import PairCheckConfig
from .flags import add_config_flags, config_overrides


def register(sub) -> None:
    """Add the `pair` command group."""
    pair = sub.add_parser("pair", help="check a target and a drafter against each other")
    psub = pair.add_subparsers(dest="pair_command", required=True, metavar="ACTION")
    check = psub.add_parser("check", help="do they fit, and does hybrid decoding pay here and on a GPU?",
                            description="Compares the vocabularies first (nothing loads if they differ), then "
                                        "measures the drafter's acceptance and cost and the target's pass costs on "
                                        "this machine, and predicts hybrid over cloud-only with the edge's policy.")
    check.add_argument("--config", help="YAML file of PairCheckConfig keys; flags override it")
    check.add_argument("--json", action="store_true", help="print the report as one JSON object")
    add_config_flags(check.add_argument_group("settings (PairCheckConfig keys)"), PairCheckConfig)
    check.set_defaults(run=run_check)


def run_check(args) -> int:
    """Check and measure with a progress bar on stderr; print the table (or JSON)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..lab.pairs import check

    config = load_config(PairCheckConfig, args.config, config_overrides(args, PairCheckConfig))
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        def progress(label: str, total: int):
            task = bar.add_task(label, total=total)
            return lambda: bar.advance(task)

        report = check(config, progress)
    if args.json:
        print(json.dumps(report))
    else:
        Console().print(table(report))
    return 0


def table(report: dict):
    """The report as a readable table."""
    from rich.table import Table

    pair, acc = report["pair"], report["acceptance"]
    out = Table(title=f"pair check: {report['target']}  +  {report['drafter']}", show_header=False, box=None)
    out.add_column(style="bold")
    out.add_column()
    out.add_row("vocabulary", f"identical: {pair['vocab_size']} tokens, {len(pair['special_tokens'])} special")
    out.add_row("chat template", "identical" if pair["same_chat_template"] else "differs (see notes)")
    out.add_row("context", f"max_context {pair['max_context']}; trained for: target {pair['target_context'] or '?'}, "
                           f"drafter {pair['drafter_context'] or '?'}")
    for note in pair["notes"]:
        out.add_row("note", note)
    out.add_row("target engine", f"{report['engine']} ({report['weights']}), {report['threads']} thread(s)")
    out.add_row("t(1)..t(k) ms", " ".join(f"{t:.1f}" for t in report["target_pass_ms"]))
    out.add_row("d(1)..d(k) ms", " ".join(f"{d:.1f}" for d in report["drafter_ms"])
                + f"  (a draft after k new tokens; c = d(1)/t(1) = {report['c']:.3f})")
    out.add_row("acceptance α_j", " ".join(f"{a:.2f}" for a in acc["by_position"])
                + f"  ({report['rounds']} rounds over {report['prompts']} prompts, "
                  f"{acc['mean_accepted']:.2f} accepted per round)")
    out.add_row("agreement", f"{acc['agreement']:.2f} of the drafts checked at any position are the target's token "
                             f"(per prompt {min(acc['per_prompt']):.2f} to {max(acc['per_prompt']):.2f})")
    for key, label in (("here", "this machine"), ("gpu", "on a GPU")):
        p = report[key]
        if p is None:
            out.add_row(label, "no recorded GPU pass table (docs/engine/gpu/)")
            continue
        where = "" if key == "here" else f"  [{p['where']}]"
        out.add_row(label, f"hybrid {p['speedup']:.2f}x cloud-only at γ = {p['gamma']} ({p['draft_ms']:.1f} ms per "
                           f"drafted token, {report['rtt_ms']:g} ms per round beyond t); the edge would choose "
                           f"{p['choice']}{where}")
    out.add_row("took", f"{report['seconds']:.0f} s")
    return out
