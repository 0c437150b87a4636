"""Honest edges against a cloud under attack: every generation must equal the cloud's own greedy
decoding (`--cloud-only`, taken before the attack), and the cloud's memory must stay bounded.

`cloud serve` (a local Ray pool, the embedded target) on one core, the edges on the other; fuzz with
--cloud sends to that running server instead. docs/integrity.md#measured has the method and the numbers.
Exit status 1 if a generation differed from the cloud-only one or failed (or a fuzzed reply broke a rule).
"""
from __future__ import annotations

import contextlib
import csv
import json
import os
import random
import signal
import subprocess
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

from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.loading import load_model
from hybridspec.distill.prompts import FREEFORM_PROMPTS, heldout_prompts
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.prompt import encode_prompt
from hybridspec.edge.worker import EdgeWorker
from hybridspec.netem.relay import BackgroundLink
from hybridspec.netem.shaping import LinkSpec
from harness import (arguments, cloud, figure, frozen, fuzz_suite, header, median, process_tree, replica_processes,
                     report, rss_mb, save_figure, series, write_json)

CHAOS_TOKENS, FUZZ_TOKENS = 48, 32
FUZZ_PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is.", "Give three tips for sleeping well."]
SAMPLE_S = 5.0
KILL_EVERY_S = (60.0, 150.0)  # a replica is killed after a random wait in this range
CUT_EVERY_S = (30.0, 90.0)
CUT_FOR_S = (1.0, 4.0)


def models(questions: list[str], new_tokens: int, address: str):
    """(drafter, encoded prompts, the cloud's own answers): each prompt decoded `--cloud-only` on whatever
    engine and weights the cloud serves, before any attack starts; hybrid rounds must reproduce exactly that."""
    drafter = load_model(default_paths()["drafter"], device="cpu")
    prompts = [encode_prompt(drafter.tokenizer, q, chat=True) for q in questions]
    with VerifierClient(address, timeout_s=120) as client:
        worker = EdgeWorker(drafter, client, EdgeConfig.of(cloud=address, max_new_tokens=new_tokens, cloud_only=True))
        return drafter, prompts, [worker.generate(p).token_ids for p in prompts]


def chaos(args) -> int:
    """Edges, replica kills and link cuts for `args.minutes`; 0 when every generation was exact."""
    rng = random.Random(args.seed)
    keys = {"torch_threads": 1, "replicas": args.replicas, "replica_num_cpus": 1.0 / args.replicas,
            "max_sessions": 2 * args.edges, "max_sessions_per_address": 2 * args.edges,
            "max_calls_per_address": 4 * args.edges}
    # 1. The cloud on its own core; edges, link and chaos on the other; the cloud's own answers.
    with cloud(keys) as (proc, address):
        front_door = psutil.Process(proc.pid)
        link = BackgroundLink(LinkSpec.symmetric(delay_ms=5.0, stall_ms=2000.0, stall_every_s=45.0), address)
        drafter, prompts, expected = models(heldout_prompts(4, seed=5) + FREEFORM_PROMPTS[:4], CHAOS_TOKENS, address)

        # 2. Edges generate until the time is up; every result is checked.
        deadline = time.monotonic() + 60 * args.minutes
        results = {"equal": 0, "different": 0, "failed": 0, "unverified_left": 0}
        failures: list[str] = []
        lock = threading.Lock()

        def edge(i: int) -> None:
            extra = {} if i % 2 else {"gamma_policy": "fixed", "cloud_only_switch": False, "max_draft": 4}
            config = EdgeConfig.of(cloud=link.address, max_new_tokens=CHAOS_TOKENS, allow_unverified=True,
                                   timeout_s=30, reconnect_s=0.5, **extra)
            n = i
            while time.monotonic() < deadline:
                try:
                    with VerifierClient(link.address, timeout_s=config.link.timeout_s) as client:
                        worker = EdgeWorker(drafter, client, config)
                        while time.monotonic() < deadline:
                            gen = worker.generate(prompts[n % len(prompts)])
                            with lock:
                                results["unverified_left"] += bool(gen.stats.unverified)
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

        # 3. Chaos and memory samples until the deadline.
        events: list[tuple[float, str]] = []
        samples: list[dict] = []
        start = time.monotonic()
        next_kill, next_cut, next_sample = start + rng.uniform(*KILL_EVERY_S), start + rng.uniform(*CUT_EVERY_S), start
        bar = tqdm(total=int(60 * args.minutes), desc="soak", unit="s")
        try:
            while (now := time.monotonic()) < deadline:
                if now >= next_kill:
                    if victims := replica_processes(proc.pid):
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
                                    "replica_mb": round(rss_mb(replica_processes(proc.pid)), 1), **results})
                    next_sample += SAMPLE_S
                    bar.update(int(now - start) - bar.n)
                    bar.set_postfix(equal=results["equal"], bad=results["different"] + results["failed"])
                time.sleep(0.2)
        finally:
            bar.close()
            for t in threads:
                t.join(timeout=120)
            link.stop()

    # 4. Report.
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


def fuzz(args) -> int:
    """`args.messages` hostile messages beside one honest edge; 0 when nothing broke a rule."""
    served = contextlib.nullcontext((None, args.cloud)) if args.cloud else cloud({"torch_threads": 1})
    with served as (proc, address):
        rss_before = rss_mb(process_tree(proc.pid)) if proc else None
        drafter, prompts, expected = models(FUZZ_PROMPTS, FUZZ_TOKENS, address)
        stop, honest, errors = threading.Event(), [], []

        def honest_edge() -> None:
            config = EdgeConfig.of(cloud=address, max_new_tokens=FUZZ_TOKENS)
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
        Fuzzer, calls = fuzz_suite()
        fuzzer = Fuzzer(channel)
        bar = tqdm(total=args.messages, desc="fuzz", unit="msg")

        @settings(max_examples=args.messages, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(call=calls(fuzzer.live, fuzzer.sessions))
        def send(call):
            fuzzer.send(*call)
            bar.update(1)
            bar.set_postfix(ok=fuzzer.counts["OK"], bad=len(fuzzer.violations), honest=f"{sum(honest)}/{len(honest)}")

        edge = threading.Thread(target=honest_edge)
        edge.start()
        start = time.perf_counter()
        try:
            send()
        finally:
            stop.set()
            edge.join(timeout=300)
            bar.close()
            channel.close()
            elapsed = time.perf_counter() - start
            rss_after = rss_mb(process_tree(proc.pid)) if proc else None
    result = {"messages": sum(fuzzer.counts.values()), "seconds": round(elapsed, 1), "status_counts": dict(fuzzer.counts),
              "violations": len(fuzzer.violations), "violation_examples": fuzzer.violations[:10],
              "honest_generations": len(honest), "honest_equal_to_target": sum(honest), "honest_errors": errors,
              "server_rss_mb_before": rss_before and round(rss_before),
              "server_rss_mb_after": rss_after and round(rss_after)}
    report(result, args.out / "fuzz.json", indent=2)
    return 0 if not fuzzer.violations and not errors and honest and all(honest) else 1


def long_text(tokenizer, tokens: int, salt: int) -> str:
    """Ordinary prose of about `tokens` tokens (held-out prompts, repeated), different for each salt."""
    pieces, text = heldout_prompts(40, seed=salt) + FREEFORM_PROMPTS, ""
    while len(tokenizer.encode(text)) < tokens:
        text += " " + pieces[len(text) % len(pieces)]
    return text


def tenants(args) -> int:
    """Fair share on and off; eviction, refusal, progress lines and a stopped replica on the first run."""
    from hybridspec.common.protocol.errors import FailedPrecondition, HybridSpecError
    from hybridspec.common.protocol.wire import DecodeSpec, DraftBlock, SessionSpec
    from hybridspec.common.security.credentials import add_identity
    from hybridspec.edge.config import CloudAccess

    path = args.out / "tenants-credentials.yaml"
    tokens = {name: add_identity(path, name) for name in ("honest", "busy")}
    drafter = load_model(default_paths()["drafter"], device="cpu")
    tok = drafter.tokenizer
    chat = encode_prompt(tok, "Give three tips for sleeping well.", chat=True)
    busy_prompt = tuple(tok.encode(long_text(tok, 3000, 7))[:3000])
    result = header(engine="cloud serve defaults, one replica", busy_sessions=args.busy, busy_prompt_tokens=3000)

    def run(fair: bool) -> dict:
        keys = {"credentials": str(path), "fair_share": fair}
        with cloud(keys) as (proc, address):
            access = {name: CloudAccess(token=token) for name, token in tokens.items()}
            out: dict = {}
            honest = VerifierClient(address, timeout_s=120, access=access["honest"])
            if fair:  # 1. the honest identity's conversation, left idle from here on
                kept = honest.open_session(SessionSpec("", tuple(tok.encode(long_text(tok, 600, 3))[:600])))
                kept_at = time.monotonic()
            worker = EdgeWorker(drafter, honest, EdgeConfig.of(cloud=address, max_new_tokens=24))
            worker.generate(chat)  # warm-up

            def honest_times(spans: list) -> list[float]:
                for _ in range(5):
                    time.sleep(args.think_s)
                    spans.append((time.monotonic(), None))
                    worker.generate(chat)
                    spans[-1] = (spans[-1][0], time.monotonic())
                return [round(b - a, 3) for a, b in spans]

            out["honest_alone_s"] = honest_times([])
            # 2. The busy identity: its sessions (one prefill, the rest start from its cached prefix), each
            #    decoding cloud-only, tokens counted as they come.
            busy = [VerifierClient(address, timeout_s=300, access=access["busy"]) for _ in range(args.busy + 4)]
            got: list[float] = []
            stop = threading.Event()

            def decode(client: VerifierClient, sid: str) -> None:
                try:
                    for _ in client.decode(DecodeSpec(sid, 0, len(busy_prompt), 1000)):
                        got.append(time.monotonic())
                        if stop.is_set():
                            return
                except HybridSpecError:
                    pass  # stopped: its session was closed

            def busy_session(client: VerifierClient) -> str:
                sid = client.open_session(SessionSpec("", busy_prompt)).session_id
                threading.Thread(target=decode, args=(client, sid), daemon=True).start()
                return sid

            started = time.monotonic()
            sessions = [busy_session(client) for client in busy[:args.busy]]
            out["busy_opened_s"] = round(time.monotonic() - started, 1)
            time.sleep(30)  # every stream under way, streams rotating
            replica = replica_processes(proc.pid)
            spans, window, cpu = [], time.monotonic(), cpu_s(replica)
            out["honest_beside_s"] = honest_times(spans)
            took, cpu = time.monotonic() - window, cpu_s(replica) - cpu
            out["busy_tokens_per_s_beside"] = round(sum(window <= t for t in got) / took, 2)
            # Per second of the replica's own CPU time: what the machine's other load does not change.
            out["busy_tokens_per_replica_cpu_s"] = round(sum(window <= t for t in got) / cpu, 2)
            during = sum(b - a for a, b in spans)
            out["busy_tokens_per_s_during_requests"] = round(sum(any(a <= t <= b for a, b in spans)
                                                                 for t in got) / during, 2)
            if fair:  # 3. More busy sessions, each decoding at once, until the replica has no room.
                out["busy_refusal"] = ""
                for client in busy[args.busy:]:
                    try:
                        sessions.append(busy_session(client))
                    except HybridSpecError as exc:
                        out["busy_refusal"] = str(exc)
                        break
                block = DraftBlock(kept.session_id, 0, 600, ())
                out["honest_idle_conversation"] = {"idle_s": round(time.monotonic() - kept_at, 1)}
                try:
                    honest.verify(block)
                    out["honest_idle_conversation"]["evicted"] = False
                except FailedPrecondition as exc:
                    out["honest_idle_conversation"].update(evicted=True, error=str(exc))
                except HybridSpecError as exc:  # kept, but not served: also a failure of the share
                    out["honest_idle_conversation"].update(evicted=False, error=str(exc))
            stop.set()
            for client, sid in zip(busy, sessions):
                client.close_session(sid)
            if fair:  # 4. `edge generate` on a cold 2,700-token prompt: its progress lines; then a stopped replica.
                out["progress"] = edge_generate(address, tokens["honest"], long_text(tok, 2700, 11))
                with frozen(replica_processes(proc.pid)):
                    out["stopped_replica"] = edge_generate(address, tokens["honest"], long_text(tok, 2731, 13))
            for client in busy + [honest]:
                client.close()
            return out

    result["fair_share_on"], result["fair_share_off"] = run(True), run(False)
    on, off = result["fair_share_on"], result["fair_share_off"]
    result["summary"] = {
        "honest_alone_s": median(on["honest_alone_s"]), "honest_beside_on_s": median(on["honest_beside_s"]),
        "honest_beside_off_s": median(off["honest_beside_s"]),
        "beside_over_alone_on": round(median(on["honest_beside_s"]) / median(on["honest_alone_s"]), 2),
        "busy_throughput_on_over_off": round(on["busy_tokens_per_s_beside"] / off["busy_tokens_per_s_beside"], 2),
        "busy_per_cpu_on_over_off": round(on["busy_tokens_per_replica_cpu_s"] / off["busy_tokens_per_replica_cpu_s"], 2),
        "beside_over_alone_off": round(median(off["honest_beside_s"]) / median(off["honest_alone_s"]), 2),
        "busy_throughput_on_over_off_during_requests": round(on["busy_tokens_per_s_during_requests"]
                                                             / off["busy_tokens_per_s_during_requests"], 2)}
    path.unlink()
    report(result, args.out / "tenants.json")
    return 0


def cpu_s(procs: list[psutil.Process]) -> float:
    """CPU seconds these processes have used (user and system)."""
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def edge_generate(address: str, token: str, prompt: str) -> dict:
    """`hybridspec edge generate` on `prompt` (4 new tokens): its wall time, exit status, the gaps between
    its progress lines on stderr, and its last stderr line."""
    cmd = [sys.executable, "-m", "hybridspec.cli.main", "edge", "generate", "--cloud", address, "--prompt", prompt,
           "--max-new-tokens", "4"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "HYBRIDSPEC_TOKEN": token})
    lines = [(time.monotonic(), line.strip()) for line in proc.stderr]
    proc.wait()
    at = [start] + [t for t, line in lines if "prompt tokens" in line]
    gaps = [round(b - a, 2) for a, b in zip(at[1:], at[2:])]
    return {"wall_s": round(time.monotonic() - start, 2), "exit": proc.returncode, "progress_lines": len(at) - 1,
            "first_line_after_s": round(at[1] - start, 2) if len(at) > 1 else None,
            "max_gap_s": max(gaps, default=None), "median_gap_s": median(gaps) if gaps else None,
            "last_line": lines[-1][1] if lines else ""}


def main() -> int:
    parser = arguments(__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    soak = commands.add_parser("chaos", help="concurrent edges, replica kills and link cuts for minutes")
    soak.add_argument("--edges", type=int, default=32)
    soak.add_argument("--minutes", type=float, default=10.0)
    soak.add_argument("--replicas", type=int, default=1)
    soak.add_argument("--seed", type=int, default=0)
    hostile = commands.add_parser("fuzz", help="10^4+ hostile messages beside an honest edge")
    hostile.add_argument("--messages", type=int, default=10_000)
    hostile.add_argument("--cloud", help="fuzz this running server instead of starting one")
    shared = commands.add_parser("tenants", help="two identities on one replica: fair share, eviction, liveness")
    shared.add_argument("--busy", type=int, default=17, help="the busy identity's sessions")
    shared.add_argument("--think-s", type=float, default=2.0, help="the honest identity's pause before each request")
    for command in (soak, hostile, shared):
        command.add_argument("--out", type=Path, default=Path("docs/integrity"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    return {"chaos": chaos, "fuzz": fuzz, "tenants": tenants}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
