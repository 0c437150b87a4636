"""What the benchmarks record about the machine they ran on (imported by the scripts beside it)."""
from __future__ import annotations


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" where it has none)."""
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
