"""A replica's memory with many short idle sessions: this code against an earlier commit, in one run.

    python bench/replica_memory.py [--baseline-commit fcced8a] [--sessions 64] [--tokens 200] [--out FILE]

For each code (this checkout, and `--baseline-commit`'s files extracted with `git archive` and imported
in its place), `cloud serve --backend inprocess` with its defaults (the front door is the replica: one
process; only the per-address session limit raised to `--sessions`) on core 1; `--sessions` sessions of `--tokens` distinct prompt tokens each are opened one by
one and left idle. The process's resident memory (VmRSS) is read when it is serving and after the
sessions are open.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from unittest import mock
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.gguf import served_weights
from hybridspec.common.protocol.wire import SessionSpec
from hybridspec.edge.client import VerifierClient
from harness import arguments, commit, header, report, start_cloud, stop_cloud

PACKAGES = ("cli", "cloud", "common", "distill", "edge", "fetch", "lab", "netem")
ROOT = Path(__file__).resolve().parent.parent


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no VmRSS for process {pid}")


def baseline_path(commit: str, workdir: Path) -> Path:
    """A directory whose `hybridspec` package is `commit`'s code (put first on PYTHONPATH)."""
    src = workdir / "src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, *PACKAGES], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    package = workdir / "path" / "hybridspec"
    package.mkdir(parents=True)
    for name in PACKAGES:
        (package / name).symlink_to(src / name)
    return package.parent


def measure(sessions: int, tokens: int, pythonpath: str = "") -> dict:
    """RSS of a default in-process `cloud serve` idle, then with the sessions open."""
    keys = {"backend": "inprocess", "max_sessions_per_address": sessions}
    with mock.patch.dict(os.environ, {"PYTHONPATH": pythonpath} if pythonpath else {}):
        proc, address = start_cloud(keys, pin_edge=False)  # with the baseline's code first on its path
    try:
        idle = rss_mib(proc.pid)
        rng = np.random.default_rng(0)
        with VerifierClient(address, timeout_s=120) as client:
            for _ in range(sessions):
                client.open_session(SessionSpec("", tuple(rng.integers(100, 40000, tokens).tolist())))
        return {"rss_serving_mib": idle, "rss_with_sessions_mib": rss_mib(proc.pid)}
    finally:
        stop_cloud(proc)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--baseline-commit", default="fcced8a")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    head = commit()
    with tempfile.TemporaryDirectory() as workdir:
        baseline = measure(args.sessions, args.tokens, str(baseline_path(args.baseline_commit, Path(workdir))))
    current = measure(args.sessions, args.tokens)
    result = {**header(weights=served_weights(default_paths()["target"])),
              "server": "cloud serve --backend inprocess, defaults, core 1", "sessions": args.sessions,
              "prompt_tokens": args.tokens, args.baseline_commit: baseline, f"{head} (this code)": current,
              "ratio": round(current["rss_with_sessions_mib"] / baseline["rss_with_sessions_mib"], 3)}
    report(result, args.out)


if __name__ == "__main__":
    main()
