"""Chaos + soak: many concurrent edges for many minutes while the replica is killed and the link is
cut and stalled at random. Every generation must equal the target's own greedy decoding, and the
cloud's memory must stay bounded.

    python bench/soak.py [--edges 32] [--minutes 10] [--replicas 1] [--out docs/integrity]

It starts `hybridspec cloud serve` (local Ray pool, embedded target) pinned to one core and runs the
edges (embedded drafter, `allow_unverified`, half of them with the default adaptive edge and half
with fixed blocks of 4) on the other, through the user-space link emulator (5 ms each way, a 2 s
stall every 45 s). At random moments it SIGKILLs a replica actor process (Ray restarts it) and cuts
the link for 1-4 s. Every 5 s it samples the resident memory of the front door and of the replica.
Writes soak.csv (samples), soak.json (summary) and soak.png (memory over time, with the chaos
events marked). Exit status 1 if any generation differed from the target's or failed.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import psutil
import torch
from tqdm import tqdm

from hybridspec.cloud.process import start_cloud_process, stop_cloud_process
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.loading import load_model
from hybridspec.distill.prompts import FREEFORM_PROMPTS, heldout_prompts
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.prompt import encode_prompt
from hybridspec.edge.worker import EdgeWorker
from hybridspec.netem.relay import BackgroundLink
from hybridspec.netem.shaping import LinkSpec
from harness import figure, pin, save_figure, series, usable_cores, write_json

NEW_TOKENS = 48
SAMPLE_S = 5.0
KILL_EVERY_S = (60.0, 150.0)  # a replica is killed after a random wait in this range
CUT_EVERY_S = (30.0, 90.0)
CUT_FOR_S = (1.0, 4.0)


def replica_processes(front_door: psutil.Process) -> list[psutil.Process]:
    """The replica actors among the front door's descendants (Ray names them ray::VerifierReplica)."""
    found = []
    for proc in front_door.children(recursive=True):
        try:
            if "VerifierReplica" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.NoSuchProcess:
            pass
    return found


def rss_mb(procs: list[psutil.Process]) -> float:
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def references(target, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """The target's own greedy continuation of each prompt (cut after an end-of-sequence token)."""
    eos = set(target.eos_token_ids)
    out = []
    for p in prompts:
        ids = target.model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=new_tokens,
                                    attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
        out.append(ids[:next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("docs/integrity"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    cores = usable_cores()
    paths = default_paths()

    # 1. The cloud on its own core; edges, link and chaos on the other.
    proc, address, log = start_cloud_process(
        {"torch_threads": 1, "replicas": args.replicas, "replica_num_cpus": 1.0 / args.replicas,
         "max_sessions": 2 * args.edges, "max_sessions_per_address": 2 * args.edges,
         "max_calls_per_address": 4 * args.edges},
        cores={cores[0]} if len(cores) > 1 else None)
    if len(cores) > 1:
        pin(cores[1:])
    front_door = psutil.Process(proc.pid)
    print(f"cloud serve at {address} (log {log})", flush=True)
    link = BackgroundLink(LinkSpec.symmetric(delay_ms=5.0, stall_ms=2000.0, stall_every_s=45.0), address)

    # 2. Prompts and the target's own answers.
    target = load_model(paths["target"], device="cpu")
    drafter = load_model(paths["drafter"], device="cpu")
    prompts = [encode_prompt(target.tokenizer, t, chat=True) for t in heldout_prompts(4, seed=5) + FREEFORM_PROMPTS[:4]]
    expected = references(target, prompts)
    del target

    # 3. Edges generate until the time is up; every result is checked.
    deadline = time.monotonic() + 60 * args.minutes
    results = {"equal": 0, "different": 0, "failed": 0, "unverified_left": 0}
    failures: list[str] = []
    lock = threading.Lock()

    def edge(i: int) -> None:
        extra = {} if i % 2 else {"gamma_policy": "fixed", "cloud_only_switch": False, "max_draft": 4}
        config = EdgeConfig(cloud=link.address, max_new_tokens=NEW_TOKENS, allow_unverified=True, timeout_s=30,
                            reconnect_s=0.5, **extra)
        n = i
        while time.monotonic() < deadline:
            try:
                with VerifierClient(link.address, timeout_s=config.timeout_s) as client:
                    worker = EdgeWorker(drafter, client, config)
                    while time.monotonic() < deadline:
                        gen = worker.generate(prompts[n % len(prompts)])
                        with lock:
                            if gen.stats.unverified:
                                results["unverified_left"] += 1
                            key = "equal" if gen.token_ids == expected[n % len(prompts)] else "different"
                            results[key] += 1
                            if key == "different":
                                failures.append(f"edge {i} prompt {n % len(prompts)}: {gen.token_ids}")
                        n += 1
            except Exception as exc:  # counted; the edge starts again with a new worker
                with lock:
                    results["failed"] += 1
                    failures.append(f"edge {i}: {type(exc).__name__}: {exc}")
                time.sleep(1.0)

    threads = [threading.Thread(target=edge, args=(i,), daemon=True) for i in range(args.edges)]
    for t in threads:
        t.start()

    # 4. Chaos and memory samples until the deadline.
    events: list[tuple[float, str]] = []
    samples: list[dict] = []
    start = time.monotonic()
    next_kill = start + rng.uniform(*KILL_EVERY_S)
    next_cut = start + rng.uniform(*CUT_EVERY_S)
    next_sample = start
    bar = tqdm(total=int(60 * args.minutes), desc="soak", unit="s")
    try:
        while (now := time.monotonic()) < deadline:
            if now >= next_kill:
                victims = replica_processes(front_door)
                if victims:
                    rng.choice(victims).send_signal(signal.SIGKILL)
                    events.append((now - start, "replica killed"))
                next_kill = now + rng.uniform(*KILL_EVERY_S)
            if now >= next_cut:
                cut = rng.uniform(*CUT_FOR_S)
                link.set_down(True)
                threading.Timer(cut, link.set_down, args=(False,)).start()
                events.append((now - start, f"link cut {cut:.1f} s"))
                next_cut = now + cut + rng.uniform(*CUT_EVERY_S)
            if now >= next_sample:
                samples.append({"t_s": round(now - start, 1), "front_door_mb": round(rss_mb([front_door]), 1),
                                "replica_mb": round(rss_mb(replica_processes(front_door)), 1),
                                **{k: v for k, v in results.items()}})
                next_sample += SAMPLE_S
                bar.update(int(now - start) - bar.n)
                bar.set_postfix(equal=results["equal"], bad=results["different"] + results["failed"])
            time.sleep(0.2)
    finally:
        bar.close()
        for t in threads:
            t.join(timeout=120)
        link.stop()
        stop_cloud_process(proc)

    # 5. Report.
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "soak.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(samples[0]))
        writer.writeheader()
        writer.writerows(samples)
    summary = {"edges": args.edges, "minutes": args.minutes, "replicas": args.replicas, **results,
               "replica_kills": sum("killed" in e for _, e in events),
               "link_cuts": sum("cut" in e for _, e in events), "events": events,
               "front_door_mb": {"first": samples[0]["front_door_mb"], "max": max(s["front_door_mb"] for s in samples),
                                 "last": samples[-1]["front_door_mb"]},
               "replica_mb": {"max": max(s["replica_mb"] for s in samples), "last": samples[-1]["replica_mb"]},
               "failures": failures[:20]}
    write_json(args.out / "soak.json", summary, indent=2)
    plot(samples, events, args.out / "soak.png", args.edges)
    print(json.dumps({k: v for k, v in summary.items() if k != "events"}, indent=2))
    return 0 if results["different"] == results["failed"] == results["unverified_left"] == 0 else 1


def plot(samples: list[dict], events: list[tuple[float, str]], out: Path, edges: int) -> None:
    """Memory of front door and replica over time, chaos events as vertical lines."""
    t = [s["t_s"] / 60 for s in samples]
    fig, ax = figure(figsize=(9, 4.5))
    series(ax, 0, t, [s["front_door_mb"] for s in samples], label="front door (gRPC + Ray driver)", markers=False)
    series(ax, 1, t, [s["replica_mb"] for s in samples], label="replica (target + KV caches)", markers=False)
    for when, what in events:
        ax.axvline(when / 60, color="#CC79A7" if "killed" in what else "#999999",
                   linestyle=":" if "cut" in what else "-.", linewidth=1)
    ax.plot([], [], "-.", color="#CC79A7", label="replica killed")
    ax.plot([], [], ":", color="#999999", label="link cut")
    ax.set_xlabel("time (min)")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Soak: {edges} concurrent edges, replica kills and link cuts")
    ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, out)


if __name__ == "__main__":
    sys.exit(main())
