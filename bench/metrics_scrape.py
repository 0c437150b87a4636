"""How long a Prometheus scrape of the cloud's /metrics takes with 256 sessions open, idle and under load.

    python bench/metrics_scrape.py [--sessions 256] [--scrapes 200] [--replicas 2] [--edges 8] [--out FILE]

`hybridspec cloud serve` with a real Ray pool (tiny random target, fractional CPUs) runs on the
second core; this process, on the first, opens --sessions sessions through --edges clients, sends
one round in each (so every per-position and per-replica series exists), then scrapes /metrics over
HTTP --scrapes times with the sessions idle, and again while the edges keep sending rounds to every
session. Reported: scrape latency p50 / p95 / max and the body size. The goal is ≤ 50 ms.
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hybridspec.common.protocol.wire import DraftBlock, SessionSpec
from hybridspec.edge.client import VerifierClient
from harness import arguments, free_port, median, percentile, start_cloud, stop_cloud, tiny_target, write_json

PROMPT = (5, 17, 33, 80, 41, 9, 120, 77)
GAMMA = 4
MAX_CONTEXT = 2048


class Edge:
    """One client with its share of the sessions; sends rounds to them in turn."""

    def __init__(self, address: str, sessions: int) -> None:
        self.client = VerifierClient(address, 60)
        self.sessions = []  # [session id, committed length, next round]
        for _ in range(sessions):
            opened = self.client.open_session(SessionSpec("", PROMPT))
            self.sessions.append([opened.session_id, opened.committed_len, 0])
        self.rounds = 0

    def round(self, index: int) -> None:
        session = self.sessions[index % len(self.sessions)]
        if session[1] + GAMMA + 1 >= MAX_CONTEXT:
            return
        result = self.client.verify(DraftBlock(session[0], session[2], session[1], tuple(range(10, 10 + GAMMA))))
        session[1], session[2] = result.committed_len, session[2] + 1
        self.rounds += 1

    def run(self, stop: threading.Event) -> None:
        i = 0
        while not stop.is_set():
            self.round(i)
            i += 1


def scrape(url: str, n: int) -> tuple[list[float], int]:
    """n timed GETs of url: (milliseconds each, bytes of the last body)."""
    times, size = [], 0
    for _ in range(n):
        start = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as reply:
            size = len(reply.read())
        times.append((time.perf_counter() - start) * 1e3)
        time.sleep(0.01)
    return times, size


def summary(times: list[float]) -> dict:
    return {"p50_ms": median(times), "p95_ms": percentile(times, 95), "max_ms": max(times)}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--scrapes", type=int, default=200, help="timed scrapes per condition")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--edges", type=int, default=8, help="clients the sessions are spread over")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    target = tiny_target(Path(tmp.name))
    metrics_port = free_port()
    per_replica = -(-args.sessions // args.replicas) + 8
    keys = {"target": target, "backend": "ray", "replicas": args.replicas, "replica_num_cpus": 0.5,
            "ray_num_cpus": 2, "device": "cpu", "torch_threads": 1, "direct_verify": False,
            "max_context": MAX_CONTEXT, "max_sessions": per_replica, "max_sessions_per_address": args.sessions + 8,
            "max_calls_per_address": 2 * args.sessions + 8,
            "metrics_port": metrics_port}
    proc, address = start_cloud(keys)
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    stop = threading.Event()
    edges: list[Edge] = []
    try:
        print(f"opening {args.sessions} sessions on {args.replicas} replicas", file=sys.stderr, flush=True)
        share = [args.sessions // args.edges + (i < args.sessions % args.edges) for i in range(args.edges)]
        edges = [Edge(address, n) for n in share]
        for edge in edges:
            for i in range(len(edge.sessions)):
                edge.round(i)
        time.sleep(2.5)  # one status refresh: per-replica gauges and histograms are in
        scrape(url, 5)
        idle, size = scrape(url, args.scrapes)
        threads = [threading.Thread(target=e.run, args=(stop,), daemon=True) for e in edges]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        before = sum(e.rounds for e in edges)
        start = time.perf_counter()
        loaded, loaded_size = scrape(url, args.scrapes)
        rounds_per_s = (sum(e.rounds for e in edges) - before) / (time.perf_counter() - start)
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
        open_sessions = sum(float(line.split()[-1]) for line in text.splitlines()
                            if line.startswith("hybridspec_sessions_open{"))
    finally:
        stop.set()
        for edge in edges:
            edge.client.close()
        stop_cloud(proc)
        tmp.cleanup()
    result = {"sessions": args.sessions, "sessions_open_reported": open_sessions, "replicas": args.replicas,
              "scrapes": args.scrapes, "series": series, "body_bytes": max(size, loaded_size),
              "idle": summary(idle), "under_load": {**summary(loaded), "rounds_per_s": rounds_per_s}}
    print(f"/metrics scrape with {open_sessions:.0f} sessions open on {args.replicas} replicas ({series} series, "
          f"{result['body_bytes']} bytes), {args.scrapes} scrapes each")
    print(f"{'condition':<22} {'p50':>7} {'p95':>7} {'max':>7}  (ms)")
    for name, times in (("idle", idle), (f"load ({rounds_per_s:.0f} rounds/s)", loaded)):
        s = summary(times)
        print(f"{name:<22} {s['p50_ms']:>7.2f} {s['p95_ms']:>7.2f} {s['max_ms']:>7.2f}")
    if args.out:
        write_json(args.out, result, indent=2)


if __name__ == "__main__":
    main()
