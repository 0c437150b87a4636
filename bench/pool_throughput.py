"""Verifier throughput with N concurrent edge sessions, batched vs unbatched, in the same run.

    python bench/pool_throughput.py [--sessions 1 4 8 16] [--gamma 4] [--rounds 8] [--out docs/pool]
    python bench/pool_throughput.py --core --device cuda      # the verifier core alone (no gRPC, no Ray)

Every edge drafts the target's own greedy continuation, so each round commits γ+1 tokens and the
number measured is the verifier's: committed ("verified") tokens per second over all sessions.
Default mode: real edges (one thread and gRPC channels each) open sessions at the real front door,
which routes them to one Ray replica, and stream their rounds to that replica (direct verify); a batched and an unbatched pool (max_batch_size 16 vs 1) run side by side
in one Ray cluster. With two or more cores the replicas get one core and the front door plus the
edges the other, one torch thread each, as if on two hosts. It also measures one round's latency
through front door + Ray against a direct in-process call of the verifier core.
--core drives Verifier.verify_batch directly (what a replica does per batch): the batching gain on
the replica's own device, e.g. a GPU, without gRPC and Ray.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.loading import load_model
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec
from hybridspec.distill.data import generate_samples
from hybridspec.distill.prompts import heldout_prompts
from harness import arguments, figure, median, pin, save_figure, series, usable_cores

MAX_BATCH = 16
LIMITS = VerifierLimits(max_context=2048, max_draft=32, max_sessions=64)


def references(target, sessions: int, tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy continuation) per session: what every edge will draft. Only answers that run
    the full length without an end-of-sequence token qualify, so every round drafts γ tokens."""
    eos = set(target.eos_token_ids)
    samples = generate_samples(target, heldout_prompts(3 * sessions, seed=11), tokens, 0.0, 16, 0,
                               "reference answers")
    full = [(s.ids[: s.start], s.ids[s.start:]) for s in samples
            if len(s.ids) - s.start == tokens and not eos & set(s.ids[s.start:])]
    if len(full) < sessions:
        raise SystemExit(f"only {len(full)} of {3 * sessions} reference answers run {tokens} tokens; use fewer rounds")
    return full[:sessions]


def block(sid: str, ref: tuple[list[int], list[int]], r: int, committed_len: int, gamma: int) -> DraftBlock:
    """Round r of a session that drafts the next gamma reference tokens after what is committed.

    All of them are accepted unless the verifier's numerics part from the reference's (bf16 on a GPU
    can flip a near-tie); then fewer tokens are committed, and counted, that round.
    """
    prompt, cont = ref
    start = committed_len - len(prompt)
    return DraftBlock(sid, r, committed_len, tuple(cont[start: start + gamma]))


def run_core(verifier: Verifier, refs, gamma: int, rounds: int, batched: bool) -> float:
    """Committed tokens/s when one caller drives all sessions, round by round."""
    lengths = [verifier.open_session(SessionSpec(f"core-{i}", tuple(prompt))).committed_len
               for i, (prompt, _) in enumerate(refs)]
    committed = 0
    start = time.perf_counter()
    for r in range(rounds):
        blocks = [block(f"core-{i}", ref, r, lengths[i], gamma) for i, ref in enumerate(refs)]
        results = verifier.verify_batch(blocks) if batched else [verifier.verify(b) for b in blocks]
        committed += sum(res.num_accepted + 1 for res in results)
        lengths = [res.committed_len for res in results]
    elapsed = time.perf_counter() - start
    for i in range(len(refs)):
        verifier.close_session(f"core-{i}")
    return committed / elapsed


def run_edges(address: str, refs, gamma: int, rounds: int) -> tuple[float, float]:
    """(committed tokens/s, median round latency ms) with one concurrent edge thread per session."""
    from hybridspec.edge.client import VerifierClient

    committed, latencies, errors = [0] * len(refs), [], []
    barrier = threading.Barrier(len(refs) + 1)

    def edge(i: int) -> None:
        try:
            with VerifierClient(address) as client:
                opened = client.open_session(SessionSpec("", tuple(refs[i][0])))
                sid, length = opened.session_id, opened.committed_len
                barrier.wait()
                for r in range(rounds):
                    t0 = time.perf_counter()
                    result = client.verify(block(sid, refs[i], r, length, gamma))
                    latencies.append(time.perf_counter() - t0)
                    committed[i] += result.num_accepted + 1
                    length = result.committed_len
                client.close_session(sid)
        except Exception as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=edge, args=(i,)) for i in range(len(refs))]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(committed) / (time.perf_counter() - start), median(latencies) * 1e3


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--target", default=str(default_paths()["target"]))
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--core", action="store_true", help="drive the verifier core directly (no gRPC, no Ray)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="docs/pool")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cores = usable_cores()
    pin = len(cores) >= 2 and not args.core
    torch.set_num_threads(1 if pin else torch.get_num_threads())
    target = load_model(args.target, device=args.device)
    refs = references(target, max(args.sessions), (args.gamma + 1) * args.rounds)
    rows = []
    if args.core:
        verifier = Verifier(target, LIMITS)
        run_core(verifier, refs[:2], args.gamma, 2, True)  # warm-up
        for n in args.sessions:
            unbatched = run_core(verifier, refs[:n], args.gamma, args.rounds, False)
            batched = run_core(verifier, refs[:n], args.gamma, args.rounds, True)
            rows.append({"sessions": n, "unbatched_tok_s": unbatched, "batched_tok_s": batched})
            print(rows[-1], flush=True)
        hop = None
    else:
        rows, hop = _pool_runs(args, target, refs, cores if pin else None)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({len(cores)} cores)"
    result = {"mode": "core" if args.core else "pool", "device": device, "gamma": args.gamma, "rounds": args.rounds,
              "rows": rows, "hop": hop}
    name = "core" if args.core else "pool"
    (out / f"{name}-{args.device.split(':')[0]}.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    (out / f"{name}-{args.device.split(':')[0]}.md").write_text(table)
    plot(result, out / f"{name}-{args.device.split(':')[0]}.png")
    print(table)


def _pool_runs(args, target, refs, cores):
    """Batched and unbatched Ray pools behind real front doors; also the per-round hop latency."""
    import ray

    from hybridspec.cloud.pool.cluster import start_local
    from hybridspec.cloud.pool.ray_pool import WORKER_ENV, RayPool
    from hybridspec.cloud.pool.specs import PoolSettings, PoolSpec, ReplicaSettings, ReplicaSpec
    from hybridspec.cloud.api.server import BackgroundServer, ReplicaEndpoint

    if cores:
        pin(cores[1])  # Ray's processes, replicas included, inherit this core
    start_local(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV},
                logging_level="ERROR")
    servers = {}
    for name, max_batch in (("unbatched", 1), ("batched", MAX_BATCH)):
        settings = ReplicaSettings(device=args.device, torch_threads=1 if cores else 0, max_batch_size=max_batch,
                                   max_wait_ms=2.0)
        pool = RayPool(PoolSpec(ReplicaSpec(args.target, settings, LIMITS), PoolSettings(replicas=1), name=name),
                       ReplicaEndpoint("127.0.0.1"))  # direct verify, the default
        servers[name] = BackgroundServer(pool)
    if cores:
        pin(cores[0])  # the front doors' loops and the edges
    try:
        for server in servers.values():
            run_edges(server.address, refs[:2], args.gamma, 2)
        rows = []
        for n in args.sessions:
            row = {"sessions": n}
            for name, server in servers.items():
                tok_s, ms = run_edges(server.address, refs[:n], args.gamma, args.rounds)
                row[f"{name}_tok_s"], row[f"{name}_round_ms"] = tok_s, ms
            rows.append(row)
            print(row, flush=True)
        # One session, one round at a time: the cost of front door + Ray over a direct call.
        via_pool = median(run_edges(servers["unbatched"].address, refs[i:i + 1], args.gamma,
                                               args.rounds)[1] for i in range(3))
    finally:
        for server in servers.values():
            server.stop()
        ray.shutdown()
    if cores:
        pin(cores[1])  # measure the direct call on the replicas' core
    verifier = Verifier(target, LIMITS)
    direct = []
    for i in range(3):
        length = verifier.open_session(SessionSpec(f"direct-{i}", tuple(refs[i][0]))).committed_len
        for r in range(args.rounds):
            t0 = time.perf_counter()
            length = verifier.verify(block(f"direct-{i}", refs[i], r, length, args.gamma)).committed_len
            direct.append(time.perf_counter() - t0)
    hop = {"direct_ms": median(direct) * 1e3, "front_door_and_ray_ms": via_pool}
    hop["added_ms"] = hop["front_door_and_ray_ms"] - hop["direct_ms"]
    return rows, hop


def markdown(r: dict) -> str:
    """The table written next to the JSON."""
    lines = [f"{r['mode']} mode on {r['device']}, γ = {r['gamma']}, {r['rounds']} rounds per session, every draft "
             "accepted (committed tokens per second over all sessions)", "",
             "| sessions | unbatched tok/s | batched tok/s | speed-up |", "|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['sessions']} | {row['unbatched_tok_s']:.1f} | {row['batched_tok_s']:.1f} | "
                     f"{row['batched_tok_s'] / row['unbatched_tok_s']:.2f}× |")
    if r["hop"]:
        h = r["hop"]
        lines += ["", f"one round, one session: direct call {h['direct_ms']:.1f} ms, through front door + Ray "
                  f"{h['front_door_and_ray_ms']:.1f} ms (added {h['added_ms']:.1f} ms)"]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    """Throughput vs sessions, batched and unbatched."""
    fig, ax = figure()
    n = [row["sessions"] for row in r["rows"]]
    series(ax, 0, n, [row["unbatched_tok_s"] for row in r["rows"]], label="unbatched (max_batch_size 1)")
    series(ax, 1, n, [row["batched_tok_s"] for row in r["rows"]], label=f"batched (max_batch_size {MAX_BATCH})")
    ax.set(xlabel="concurrent edge sessions", ylabel="verified tokens / s", xticks=n,
           title=f"verifier throughput, {r['mode']} mode, {r['device']}")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
