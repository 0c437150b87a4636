"""`hybridspec experiment run|report`: network-latency experiments with baselines in the same run."""
from __future__ import annotations

import argparse
from pathlib import Path


def register(sub) -> None:
    """Add the `experiment` command group."""
    exp = sub.add_parser("experiment", help="run and report network-latency experiments")
    esub = exp.add_subparsers(dest="experiment_command", required=True, metavar="ACTION")
    run = esub.add_parser("run", help="sweep the grid of an experiment file (resumes where it stopped)")
    run.add_argument("file", help="experiment YAML, e.g. experiments/rtt_sweep.yaml")
    run.add_argument("--out", help="results directory (default results/<name>)")
    run.add_argument("--fresh", action="store_true", help="discard earlier results instead of resuming")
    run.add_argument("--report", action="store_true", help="write the report when the run is done")
    run.set_defaults(run=run_experiment)
    rep = esub.add_parser("report", help="plots (PNG) and a Markdown summary of a results directory")
    rep.add_argument("results", help="a results directory or its results.jsonl")
    rep.add_argument("--out", help="where to write the report (default: the results directory)")
    rep.set_defaults(run=run_report)


def run_experiment(args) -> int:
    """Run (or resume) the sweep; print where the results are."""
    from ..lab.runner import run_experiment as run
    from ..lab.spec import load_spec

    spec = load_spec(args.file)
    out = Path(args.out) if args.out else Path("results") / spec.name
    rows = run(spec, out, fresh=args.fresh)
    print(f"results: {rows} and {out / 'results.csv'}")
    if args.report:
        return run_report(argparse.Namespace(results=str(out), out=None))
    return 0


def run_report(args) -> int:
    """Write the plots and summary."""
    from ..lab.report import report

    results = Path(args.results)
    if not results.exists():
        raise FileNotFoundError(f"no results at {results}")
    out = Path(args.out) if args.out else (results if results.is_dir() else results.parent)
    for path in report(results, out):
        print(path)
    return 0
