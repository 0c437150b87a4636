"""Fresh `hybridspec demo` runs, one after another, and the interval each one printed.

    python bench/demo_runs.py [--runs 5] [--out docs/experiments/demo/runs.json] [-- DEMO FLAGS]

Each run is a new `hybridspec demo` process (its own cloud, Ray cluster and edge, as a newcomer
starts it), saving its turns with `--save`; this collects them with the date, commit and machine.
Prints one line per run and writes every run's record to --out.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import arguments, commit, cpu_model, write_json


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path)
    parser.add_argument("demo_flags", nargs="*", help="passed on to `hybridspec demo` (after --)")
    args = parser.parse_args()
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
    result = {"bench": "demo_runs", "date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit(),
              "machine": {"cpu": cpu_model(), "platform": platform.platform()},
              "engine": "llamacpp (auto), the embedded pair", "demo_flags": args.demo_flags, "runs": runs}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, result)


if __name__ == "__main__":
    main()
