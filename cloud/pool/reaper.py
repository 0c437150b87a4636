"""A watchdog that takes the front door's Ray processes with it, however the front door ends.

Ray ties its core processes to the process that started the local cluster, but its dashboard and
runtime-env agents outlive a killed front door for about a minute, still holding their ports. The
reaper is a small separate process: it keeps a list of the front door's descendants (refreshed every
second) and, the moment the pipe from the front door closes — normal exit, crash or SIGKILL alike —
terminates whatever on that list is still running.

    python -m hybridspec.cloud.pool.reaper PID     (stdin: the read end of a pipe the front door holds)
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import psutil

SNAPSHOT_S = 1.0  # how often the list of descendants is refreshed
GRACE_S = 2.0  # SIGTERM, then SIGKILL for what is still running after this


def start_reaper() -> subprocess.Popen:
    """Start a reaper for this process; it acts when this process's end of the pipe closes."""
    read_end, write_end = os.pipe()  # both non-inheritable: Ray's children never hold the write end
    reaper = subprocess.Popen([sys.executable, "-m", "hybridspec.cloud.pool.reaper", str(os.getpid())], stdin=read_end,
                              start_new_session=True)  # a Ctrl-C to the front door's group spares it
    os.close(read_end)
    _held.append(write_end)  # closed by the kernel when this process ends, however it ends
    return reaper


_held: list[int] = []


def main(pid: int) -> None:
    """Track `pid`'s descendants until stdin closes, then end them."""
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), closed.set()), daemon=True).start()
    tracked: dict[int, float] = {}  # pid -> create time, so a reused pid is never hit
    me = os.getpid()
    while not closed.wait(SNAPSHOT_S):
        try:
            for child in psutil.Process(pid).children(recursive=True):
                if child.pid != me:
                    tracked.setdefault(child.pid, child.create_time())
        except psutil.NoSuchProcess:
            break
    alive = []
    for child_pid, created in tracked.items():
        try:
            proc = psutil.Process(child_pid)
            if proc.create_time() == created:
                proc.send_signal(signal.SIGTERM)
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(alive, timeout=GRACE_S)
    for proc in still:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


if __name__ == "__main__":
    main(int(sys.argv[1]))
