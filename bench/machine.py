"""What the benchmarks record about the machine they ran on (imported by the scripts beside it)."""
from __future__ import annotations


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" where it has none)."""
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


def commit() -> str:
    """The checkout's short commit, with "+dirty" when tracked files differ from it."""
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    short = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "."], cwd=repo).returncode != 0
    return (short or "unknown") + ("+dirty" if dirty else "")
