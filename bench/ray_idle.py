"""What Ray's own processes cost the replicas' host while the pool is idle: CPU per process, as a
share of one core, for a local cluster started as `cloud serve` starts one, with one actor.

    python bench/ray_idle.py [--window 30] [--repeats 3] [--out FILE]

Each setting starts its own cluster in a fresh process pinned to the cloud core, waits for it to
settle, and reads every Ray process's CPU time (/proc) over `window` seconds. Settings take turns,
repeated, so that drift hits each. "ray_default" gives Ray's log monitor Ray's own threshold (it
lists the log directory every 0.1 s below 1,000 files); "local" is what cloud/pool/cluster.py sets.
On a one-core cloud host this time comes straight out of decoding. Prints one JSON object.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time

import psutil

from harness import CLOUD_CORE, arguments, header, pin, report

SETTINGS = {"ray_default": {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "1000"}, "local": {}}
ROLES = (("raylet", "raylet"), ("gcs_server", "gcs_server"), ("log_monitor.py", "log_monitor"),
         ("autoscaler", "autoscaler_monitor"), ("dashboard", "dashboard"), ("ray::Idle", "actor"),
         ("Agent", "agents"))
SETTLE_S = 5.0


def _role(cmdline: str) -> str:
    return next((role for part, role in ROLES if part in cmdline), "other")


def _cpu_by_process(processes: list) -> dict[int, tuple[float, str]]:
    """CPU seconds (user + system) and command line of each psutil process still running."""
    out = {}
    for proc in processes:
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                out[proc.pid] = (times.user + times.system, " ".join(proc.cmdline()))
        except psutil.Error:  # ended meanwhile
            continue
    return out


def measure(env: dict[str, str], window: float, result) -> None:
    """In a fresh process: start a local cluster with one idle actor; CPU % of a core per role."""
    pin(CLOUD_CORE)
    os.environ.update(env)
    import ray

    from hybridspec.cloud.pool.cluster import start_local
    from hybridspec.cloud.pool.ray_pool import WORKER_ENV

    start_local(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV})

    @ray.remote(num_cpus=0.5)
    class Idle:
        def pid(self) -> int:
            return os.getpid()

    actor = Idle.remote()
    ray.get(actor.pid.remote())
    time.sleep(SETTLE_S)
    processes = [*psutil.Process().children(recursive=True), psutil.Process()]
    before = _cpu_by_process(processes)
    time.sleep(window)
    after = _cpu_by_process(processes)
    shares: dict[str, float] = {}
    for pid, (seconds, cmdline) in after.items():
        if pid in before:
            role = "driver" if pid == os.getpid() else _role(cmdline)
            shares[role] = shares.get(role, 0.0) + 100 * (seconds - before[pid][0]) / window
    ray.shutdown()
    result.put(shares)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--window", type=float, default=30.0, help="seconds measured per cluster")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    spawn = mp.get_context("spawn")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for repeat in range(args.repeats):
        for name, env in SETTINGS.items():
            result = spawn.Queue()
            child = spawn.Process(target=measure, args=(env, args.window, result))
            child.start()
            runs[name].append(result.get(timeout=args.window + 300))
            child.join()
            print(f"repeat {repeat + 1}/{args.repeats} {name}: {sum(runs[name][-1].values()):.2f} % of a core",
                  flush=True)
    summary = {}
    for name, shares in runs.items():
        roles = sorted({role for s in shares for role in s})
        summary[name] = {
            "total_percent_mean": round(statistics.mean(sum(s.values()) for s in shares), 2),
            "total_percent_all": [round(sum(s.values()), 2) for s in shares],
            "percent_by_role_mean": {role: round(statistics.mean(s.get(role, 0.0) for s in shares), 2)
                                     for role in roles}}
    report({**header(engine="Ray local cluster, one idle actor (no model)"), "core": CLOUD_CORE,
            "window_s": args.window, "repeats": args.repeats, "settings": SETTINGS, "idle": summary}, args.out)


if __name__ == "__main__":
    main()
