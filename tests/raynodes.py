"""An operator's own Ray cluster on this machine, made with Ray's CLI, for the tests that join one.

Everything it starts lives under a private directory (its HOME and RAY_TMPDIR) and on free ports, so
it never meets another user's Ray on the same machine: not /tmp/ray, not ~/.ray, not port 6379.
`stop` ends exactly the processes started under that directory (never `ray stop`, which would end
every Ray cluster of this user on the machine).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

RAY_CLI = [sys.executable, "-m", "ray.scripts.scripts"]


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def private_dir(prefix: str) -> Path:
    """A short private directory under /tmp: Ray's socket paths must stay under 107 bytes."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


class Operator:
    """A user's shell on this machine: its own HOME and Ray temp dir, and the Ray nodes it started."""

    def __init__(self, root: Path, **env: str) -> None:
        self.root = root
        # A fresh shell: none of the RAY_* settings this test process picked up (a local cluster started
        # here earlier sets RAY_AUTH_*, and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which refuses a second node).
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env.update(HOME=str(root), RAY_TMPDIR=str(root), HYBRIDSPEC_HOME="/nonexistent-hybridspec-home", **env)
        self.address = ""

    def ray(self, *args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
        """`ray ARGS` as this operator would type it."""
        return subprocess.run([*RAY_CLI, *args], capture_output=True, text=True, timeout=timeout,
                              env={**self.env, **(env or {})})

    def start_head(self, num_cpus: int = 1, env: dict | None = None) -> str:
        """`ray start --head` on free ports; returns the head's HOST:PORT."""
        port = free_port()
        r = self.ray("start", "--head", "--port", str(port), "--num-cpus", str(num_cpus), "--include-dashboard",
                     "false", "--dashboard-port", str(free_port()), "--ray-client-server-port", str(free_port()),
                     "--dashboard-agent-listen-port", str(free_port()), "--disable-usage-stats", env=env)
        assert r.returncode == 0, f"ray start --head failed: {r.stdout[-1500:]} {r.stderr[-1500:]}"
        self.address = f"127.0.0.1:{port}"
        return self.address

    def add_node(self, num_cpus: int = 1, env: dict | None = None) -> subprocess.CompletedProcess:
        """`ray start --address HEAD`: a second node of the cluster, on this machine."""
        return self.ray("start", "--address", self.address, "--num-cpus", str(num_cpus), "--dashboard-agent-listen-port",
                        str(free_port()), "--disable-usage-stats", env=env)

    def raylets(self) -> list[psutil.Process]:
        """The raylet of each node started here, the head's first."""
        found = [p for p in self.processes() if Path(_cmdline(p)[0]).name == "raylet"]
        return sorted(found, key=lambda p: "--head" not in _cmdline(p))

    def processes(self) -> list[psutil.Process]:
        """Every process started under this operator's directory, and their descendants."""
        me = psutil.Process()
        mine = {me.pid, *(p.pid for p in me.parents())}
        marker = str(self.root)
        roots = [p for p in psutil.process_iter() if p.pid not in mine and any(marker in a for a in _cmdline(p))]
        found = {p.pid: p for p in roots}
        for root in roots:
            try:
                found.update((child.pid, child) for child in root.children(recursive=True) if child.pid not in mine)
            except psutil.NoSuchProcess:
                pass
        return list(found.values())

    def stop(self) -> None:
        """End this operator's Ray processes and remove the directory."""
        procs = self.processes()
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=3)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline() or [proc.name()]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return [""]


class CloudServe:
    """`hybridspec cloud serve ARGS` as a subprocess of the operator's shell, its stderr kept."""

    def __init__(self, operator: Operator, *args: str, env: dict | None = None) -> None:
        self.log = operator.root / f"cloud-serve-{time.monotonic_ns()}.log"
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "hybridspec.cli.main", "cloud", "serve", *args],
                                     stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True,
                                     env={**operator.env, **(env or {})})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_serving(self, timeout_s: float) -> str:
        """The front door's HOST:PORT once it prints that it serves; fails (and kills it) after timeout_s."""
        from hybridspec.cloud.process import parse_ready_line

        deadline = self.started + timeout_s
        while time.monotonic() < deadline:
            for line in self.lines:
                if (address := parse_ready_line(line)) is not None:
                    return address
            if self.proc.poll() is not None and not self._reader.is_alive():
                raise AssertionError(f"cloud serve exited ({self.proc.returncode}): {self.stderr()[-2000:]}")
            time.sleep(0.2)
        self.proc.kill()
        raise AssertionError(f"cloud serve did not serve within {timeout_s:.0f} s: {self.stderr()[-2000:]}")

    def wait_exit(self, timeout_s: float) -> int:
        """Its exit status; kills it and fails if it is still running after timeout_s."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"cloud serve still running after {timeout_s:.0f} s: {self.stderr()[-2000:]}") from None

    def stderr(self) -> str:
        return self.log.read_text()

    def tree(self) -> list[psutil.Process]:
        """The front door and everything it started."""
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
