"""`hybridspec cloud serve` as a child process, for the demo and experiments, which need the cloud on its
own core(s), apart from the edge; and the line it prints once serving. (The port checks its start
makes are cloud/api/ports.py.)

Light on purpose (no grpc, torch or ray)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from ..common.protocol.errors import Unavailable

READY_PREFIX = "hybridspec verifier serving on "


def parse_ready_line(line: str) -> str | None:
    """HOST:PORT from the 'serving on' line, or None for any other line."""
    if not line.startswith(READY_PREFIX):
        return None
    return line[len(READY_PREFIX):].split()[0]


def start_cloud_process(overrides: dict, cores: set[int] | None = None) -> tuple[subprocess.Popen, str, Path]:
    """Start `cloud serve` with these ServeConfig keys (on a free port unless one is given), pinned to
    `cores` (everything it spawns, Ray included, inherits that); wait until it is SERVING.

    Returns the process, its HOST:PORT and the file its log goes to.
    """
    config = {"port": 0, "metrics_port": -1, **overrides}
    config_file = tempfile.NamedTemporaryFile("w", prefix="hybridspec-cloud-", suffix=".yaml", delete=False)
    yaml.safe_dump(config, config_file)
    config_file.close()
    log = tempfile.NamedTemporaryFile("w", prefix="hybridspec-cloud-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "hybridspec.cli.main", "cloud", "serve", "--config", config_file.name]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
    assert proc.stdout is not None
    for line in proc.stdout:
        address = parse_ready_line(line)
        if address is not None:
            return proc, address, Path(log.name)
    proc.wait()
    tail = Path(log.name).read_text().strip().splitlines()[-1:] or ["(no output)"]
    raise Unavailable(f"the cloud exited with status {proc.returncode} before serving: {tail[0]} (log: {log.name})")


def stop_cloud_process(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM (drain), then wait; kill if it does not stop."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
