"""Fuzz a running verifier with 10^4+ hostile messages while an honest edge generates beside it.

    python bench/fuzz.py [--messages 10000] [--cloud HOST:PORT] [--out docs/integrity]

Without --cloud it starts `hybridspec cloud serve` (the local Ray pool, embedded target) pinned to
one core, and fuzzes and runs the edge on the other. The fuzz is the suite of tests/fuzzing.py
(every RPC; random, plausible and undecodable bodies) with fresh randomness. It reports the count of
every status, any reply that broke the rules (UNKNOWN, INTERNAL, a long or traceback-bearing
message), whether every honest greedy generation equalled the target's own greedy decoding, and the
server's resident memory before and after. Exit status 1 if anything broke a rule.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc
import psutil
import torch
from hypothesis import HealthCheck, given, settings
from tqdm import tqdm

from soak import references  # noqa: E402  (bench/, this script's folder, is on the path)
from hybridspec.cloud.process import start_cloud_process, stop_cloud_process
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.loading import load_model
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.prompt import encode_prompt
from hybridspec.edge.worker import EdgeWorker
from harness import pin, tests_module, usable_cores, write_json

fuzzing = tests_module("fuzzing")  # the fuzz strategies tests/test_fuzz.py runs too
Fuzzer, calls = fuzzing.Fuzzer, fuzzing.calls

PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is.", "Give three tips for sleeping well."]
NEW_TOKENS = 32


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants (the front door, Ray and the replica)."""
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--cloud", help="fuzz this running server instead of starting one")
    parser.add_argument("--out", type=Path, default=Path("docs/integrity"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    cores = usable_cores()
    paths = default_paths()
    proc = None
    if args.cloud:
        address = args.cloud
    else:
        proc, address, log = start_cloud_process({"torch_threads": 1}, cores={cores[0]} if len(cores) > 1 else None)
        if len(cores) > 1:
            pin(cores[1:])
        print(f"cloud serve at {address} (log {log})", flush=True)
    rss_before = tree_rss_mb(proc.pid) if proc else None
    target = load_model(paths["target"], device="cpu")
    drafter = load_model(paths["drafter"], device="cpu")
    prompts = [encode_prompt(target.tokenizer, p, chat=True) for p in PROMPTS]
    expected = references(target, prompts, NEW_TOKENS)

    stop, honest, errors = threading.Event(), [], []

    def honest_edge() -> None:
        config = EdgeConfig(cloud=address, max_new_tokens=NEW_TOKENS)
        try:
            with VerifierClient(address) as client:
                worker = EdgeWorker(drafter, client, config)
                i = 0
                while not stop.is_set():
                    gen = worker.generate(prompts[i % len(prompts)])
                    honest.append(gen.token_ids == expected[i % len(prompts)])
                    i += 1
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    channel = grpc.insecure_channel(address)
    fuzzer = Fuzzer(channel)
    bar = tqdm(total=args.messages, desc="fuzz", unit="msg")

    @settings(max_examples=args.messages, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(call=calls(fuzzer.live, fuzzer.sessions))
    def fuzz(call):
        fuzzer.send(*call)
        bar.update(1)
        bar.set_postfix(ok=fuzzer.counts["OK"], bad=len(fuzzer.violations), honest=f"{sum(honest)}/{len(honest)}")

    edge = threading.Thread(target=honest_edge)
    edge.start()
    start = time.perf_counter()
    try:
        fuzz()
    finally:
        stop.set()
        edge.join(timeout=300)
        bar.close()
        channel.close()
        elapsed = time.perf_counter() - start
        rss_after = tree_rss_mb(proc.pid) if proc else None
        if proc is not None:
            stop_cloud_process(proc)
    report = {
        "messages": sum(fuzzer.counts.values()), "seconds": round(elapsed, 1), "status_counts": dict(fuzzer.counts),
        "violations": len(fuzzer.violations), "violation_examples": fuzzer.violations[:10],
        "honest_generations": len(honest), "honest_equal_to_target": sum(honest), "honest_errors": errors,
        "server_rss_mb_before": rss_before and round(rss_before), "server_rss_mb_after": rss_after and round(rss_after),
    }
    print(json.dumps(report, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "fuzz.json", report, indent=2)
    ok = not fuzzer.violations and not errors and honest and all(honest)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
