"""What the hop edge → verifier → edge costs a round beyond the forward pass: per path, in a replica's
host time under many edges, and per batching policy.

Real gRPC clients take turns round by round, so other load hits every path alike; --target tiny (the
default) is a random 2-layer Llama (tests/tinymodels.py), so the hop dominates. The paths: front-door (a
1-replica Ray pool), direct (the replica's own endpoint; its model in a process of its own, or in the
actor), in-process (the floor); overhead = the round trip − (verify_ms − queue_ms). docs/measurements.md
has the method and the numbers.
"""
from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import sys
import tempfile
import time
from dataclasses import astuple, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc
import ray
import torch

from hybridspec.cloud.api.server import BackgroundServer, ReplicaEndpoint
from hybridspec.cloud.core.heap import settle_heap
from hybridspec.cloud.core.limits import DEFAULT_HOLD, DEFAULT_MAX_WAIT_MS, Hold
from hybridspec.cloud.core.telemetry import ClockSwitch, Part
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.cloud.pool.pool import inprocess_pool
from hybridspec.cloud.pool.process_replica import process_pool
from hybridspec.cloud.pool.loading import load_verifier
from hybridspec.cloud.pool.cluster import start_local
from hybridspec.cloud.pool.ray_pool import WORKER_ENV, RayPool
from hybridspec.cloud.pool.specs import PoolSettings, PoolSpec, ReplicaSettings, ReplicaSpec
from hybridspec.common.models.loading import load_model
from hybridspec.common.protocol import codec
from hybridspec.common.protocol.channel import SHARED_OPTIONS
from hybridspec.common.protocol.proto import verifier_pb2 as pb
from hybridspec.common.protocol.proto import verifier_pb2_grpc as pb_grpc
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec
from hybridspec.edge.client import VerifierClient
from hybridspec.lab.stats import mean_ci
from harness import (CLOUD_CORE, EDGE_CORE, arguments, header, median, percentile, pin, report, tiny_target,
                     usable_cores)

PROMPT = (5, 17, 33, 80, 41, 9, 120, 77)
GAMMA = 4
DRAFT = tuple(range(10, 10 + GAMMA))  # every round's block
LIMITS = VerifierLimits(max_context=512, max_draft=32, max_sessions=8)
WARMUP_ROUNDS = 20


@dataclass
class Lane:
    """One lane under test: its client, its session and what it measured."""

    name: str
    client: VerifierClient | None = None
    session_id: str = ""
    length: int = 0
    round: int = 0
    direct: bool = False  # rounds go to a replica's own endpoint
    ms: dict[str, list[float]] = field(default_factory=lambda: {"overhead": [], "rtt": [], "forward": [], "queue": []})

    def open(self) -> None:
        """A fresh session (untimed): a fixed block's rounds grow the context until it must be renewed."""
        if self.session_id:
            self.client.close_session(self.session_id)
        opened = self.client.open_session(SessionSpec("", PROMPT))
        self.session_id, self.length, self.round = opened.session_id, opened.committed_len, 0
        self.direct = self.client.rounds_address != self.client.address

    def one_round(self, draft: tuple[int, ...], keep: bool) -> None:
        """Send one round, wait for its reply, and (keep) record where its time went."""
        if self.length + len(draft) + 1 >= LIMITS.max_context:
            was_direct = self.direct
            self.open()
            assert self.direct == was_direct, f"{self.name}: rounds changed path on a new session"
        pending = self.client.submit(DraftBlock(self.session_id, self.round, self.length, draft))
        result = self.client.wait(pending)
        self.length, self.round = result.committed_len, self.round + 1
        if keep:
            rtt, forward = (pending.arrived - pending.sent) * 1e3, result.verify_ms - result.queue_ms
            for key, value in (("rtt", rtt), ("forward", forward), ("queue", result.queue_ms), ("overhead", rtt - forward)):
                self.ms[key].append(value)


def paths(args) -> dict:
    """The paths' overhead beyond the forward pass, round by round in turns."""
    cores = usable_cores()
    pinned = args.pin and len(cores) >= 2
    tmp = tempfile.TemporaryDirectory()
    target = tiny_target(Path(tmp.name)) if args.target == "tiny" else args.target
    if pinned:
        pin(cores[1])  # Ray's processes, replicas included, inherit this core
    start_local(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV},
                logging_level="ERROR")
    servers, spec = {}, ReplicaSpec(target, ReplicaSettings(device="cpu", torch_threads=1), LIMITS)
    for name, endpoint, own in (("front-door", None, True), ("direct", ReplicaEndpoint("127.0.0.1"), True),
                                ("direct, model in the actor", ReplicaEndpoint("127.0.0.1"), False)):
        settings = PoolSettings(replicas=1, replica_num_cpus=0.5, model_process=own)  # three on a 2-CPU cluster
        servers[name] = BackgroundServer(RayPool(PoolSpec(spec, settings, name=f"hop-{len(servers)}"), endpoint))
    if pinned:
        pin(cores[0])  # the front doors' loops, the in-process verifier and the edges
    verifier = Verifier(load_model(target, device="cpu"), LIMITS)
    servers["in-process"] = BackgroundServer(inprocess_pool(verifier))
    lanes = [Lane(name, VerifierClient(server.address)) for name, server in servers.items()]
    try:
        for lane in lanes:
            lane.open()
        assert [p.direct for p in lanes] == [False, True, True, False], "only the direct paths should name an endpoint"
        for r in range(WARMUP_ROUNDS + args.rounds):
            for lane in lanes:  # round-robin: background load hits every path alike
                lane.one_round(DRAFT, keep=r >= WARMUP_ROUNDS)
    finally:
        for lane in lanes:
            lane.client.close()
        for server in servers.values():
            server.stop()
        ray.shutdown()
        tmp.cleanup()

    rows = [{"path": p.name, "overhead_p90_ms": percentile(p.ms["overhead"], 90),
             **{f"{key}_median_ms": median(p.ms[key]) for key in ("overhead", "rtt", "forward", "queue")}} for p in lanes]
    return {"target": args.target, "gamma": GAMMA, "rounds": args.rounds, "max_wait_ms": DEFAULT_MAX_WAIT_MS,
            "pinned": pinned, "cores": len(cores), "rows": rows}


MANY = VerifierLimits(max_context=512, max_draft=32, max_sessions=64)
PER_CLIENT = {"max_sessions_per_client": 64, "max_sessions_per_address": 64}  # every edge's session
WARM_S = 2.0  # closed-loop rounds before each window, untimed


def edge_process(conn) -> None:
    """The edges' process (spawned; on the edge core, one thread): runs each job the parent sends, until None."""
    if EDGE_CORE in usable_cores():
        pin(EDGE_CORE)
    torch.set_num_threads(1)
    while (job := conn.recv()) is not None:
        conn.send(asyncio.run(closed_loop(conn, **job)))


async def closed_loop(conn, address: str, edges: int, draft_ms: float) -> dict:
    """`edges` edges on a channel and VerifyStream each, drafting `draft_ms` before each round, a fresh session
    when the context fills: WARM_S untimed, then the window up to the deadline the parent sends."""
    window = [float("inf"), float("inf")]  # [start, deadline]
    latencies, seen = [], {"tokens": 0, "opens": 0}

    async def edge(stub) -> None:
        sid, length, r, call, direct = "", 0, 0, None, None
        while time.perf_counter() < window[1]:
            if call is None or length + GAMMA + 1 >= MANY.max_context:
                if call is not None:
                    call.cancel()
                    await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
                opened = codec.opened_from_pb(await stub.OpenSession(codec.session_to_pb(SessionSpec("", PROMPT))))
                if opened.verify_address and direct is None:  # rounds go to the replica's own endpoint
                    channels.append(grpc.aio.insecure_channel(opened.verify_address, options=SHARED_OPTIONS))
                    direct = pb_grpc.VerifierStub(channels[-1])
                sid, length, r, call = opened.session_id, opened.committed_len, 0, (direct or stub).VerifyStream()
                seen["opens"] += time.perf_counter() >= window[0]
            if draft_ms:
                await asyncio.sleep(draft_ms / 1e3)
            sent = time.perf_counter()
            await call.write(codec.block_to_pb(DraftBlock(sid, r, length, DRAFT)))
            result = codec.result_from_pb(await call.read())
            length, r, done = result.committed_len, r + 1, time.perf_counter()
            if window[0] <= sent and done <= window[1]:
                latencies.append((done - sent) * 1e3)
                seen["tokens"] += result.num_accepted + 1
        call.cancel()

    channels = [grpc.aio.insecure_channel(address, options=SHARED_OPTIONS) for _ in range(edges)]
    tasks = [asyncio.create_task(edge(pb_grpc.VerifierStub(channel))) for channel in channels]
    await asyncio.sleep(WARM_S)
    conn.send("warm")
    deadline = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    window[:] = [time.perf_counter(), deadline]
    await asyncio.gather(*tasks)
    await asyncio.gather(*(channel.close() for channel in channels))
    return {"rounds": len(latencies), "latency_ms": latencies, **seen}


def one_window(conn, target: str, edges: int, args, backend: str = "inprocess", **verifier) -> dict:
    """A fresh replica under `edges` closed-loop edges for one window: its steps' CPU and wall time part by part
    (StepClock), the CPU of the model's process outside its model thread (grpc where the gRPC server shares
    its interpreter; ipc, the pipe, in a process of its own, whose front door's CPU is front_door), and what
    the edges saw. A Ray replica (ray: its model in a process of its own; ray-actor: in the actor, beside
    its endpoint) takes its rounds on its own endpoint, and its passes are the target's own."""
    process, cores = backend in ("process", "apart", "ray"), usable_cores()
    settings = ReplicaSettings(device="cpu", torch_threads=1, max_batch_size=edges, pass_cost_tokens=0, **verifier)
    if backend.startswith("ray"):
        assert not args.pass_ms, "--pass-ms: a Ray replica's passes are its target's own"
        pool = RayPool(PoolSpec(ReplicaSpec(target, settings, MANY), name=f"host-{backend}-{time.monotonic_ns()}",
                                settings=PoolSettings(replicas=1, model_process=process, **PER_CLIENT)),
                       ReplicaEndpoint("127.0.0.1"))
        server, handle = BackgroundServer(pool), next(iter(pool.replicas.values())).handle
        switch = lambda on: ray.get(handle.step_clock.remote(on))
    elif process:
        loader = functools.partial(flat_replica, ReplicaSpec(target, settings, MANY), args.pass_ms, cores)
        if backend == "apart" and cores == [CLOUD_CORE]:  # the child alone on the cloud core, as on a server:
            pin(EDGE_CORE)  # the front door's threads start from here, and the child pins itself back
        server = BackgroundServer(pool := process_pool(loader, **PER_CLIENT))
        switch = lambda on: server.call(pool.replicas["process"].step_clock(on))
    else:
        replica = Verifier(load_model(target, device="cpu"), MANY, max_batch=edges, **verifier)
        at_least(replica.engine, args.pass_ms / 1e3)
        server, switch = BackgroundServer(replica), functools.partial(ClockSwitch().turn, replica)
    settle_heap()  # as a serving process does once started
    try:
        conn.send({"address": server.address, "edges": edges, "draft_ms": args.draft_ms})
        assert conn.recv() == "warm"
        switch(True)
        cpu, deadline = time.process_time(), time.perf_counter() + args.seconds
        conn.send(deadline)
        time.sleep(args.seconds)
        cpu = time.process_time() - cpu
        clock, model_cpu = switch(False)
        seen = conn.recv()
    finally:
        server.stop()
        pin(cores)
    steps = max(1, clock.steps)
    cpu_ms = {part.value: 1e3 * clock.cpu[part] / steps for part in Part}
    cpu_ms["ipc" if process else "grpc"] = 1e3 * (model_cpu - sum(clock.cpu.values())) / steps
    if backend in ("process", "apart"):  # the front door's process: all of its CPU
        cpu_ms["front_door"] = 1e3 * cpu / steps
    return {"steps": clock.steps, "rounds": clock.rounds, "rounds_per_step": clock.rounds / steps, "cpu_ms": cpu_ms,
            "hold_ms": 1e3 * clock.wall[Part.HOLD] / steps, "tokens_per_s": seen["tokens"] / args.seconds,
            "wall_ms": {part.value: 1e3 * clock.wall[part] / steps for part in Part},
            "passes_per_round": clock.steps * edges / max(1, seen["rounds"]),
            "p95_round_ms": percentile(seen["latency_ms"], 95) if seen["latency_ms"] else None, "opens": seen["opens"]}


def flat_replica(spec: ReplicaSpec, pass_ms: float, cores: list[int], measured) -> Verifier:
    """The process replica's loader: pinned to `cores`, `spec`'s verifier with passes of `pass_ms` at least."""
    pin(cores)
    verifier = load_verifier(spec, measured)
    at_least(verifier.engine, pass_ms / 1e3)
    return verifier


def at_least(engine, seconds: float) -> None:
    """Every pass of `engine` lasts at least `seconds` (a sleep after it): a flat-cost device, as a GPU is."""
    if not seconds:
        return
    forward = engine.forward

    def flat(feeds):
        start = time.perf_counter()
        scores = forward(feeds)
        time.sleep(max(0.0, seconds - (time.perf_counter() - start)))
        return scores

    engine.forward = flat


def windows(args, runs: list[tuple[str, int, dict]]) -> tuple[dict[str, list[dict]], dict]:
    """Every (label, edges, verifier settings) once per repeat, in turns, on the cloud core, the edges in a
    spawned process on the edge core: the runs by label, and the setting."""
    setting = {"target": args.target, "gamma": GAMMA, "seconds": args.seconds, "repeats": args.repeats,
               "draft_ms": args.draft_ms, "pass_ms": args.pass_ms, "cores": len(usable_cores())}
    load_before = os.getloadavg()
    tmp = tempfile.TemporaryDirectory()
    target = tiny_target(Path(tmp.name)) if args.target == "tiny" else args.target
    conn, child = multiprocessing.get_context("spawn").Pipe()
    edges = multiprocessing.get_context("spawn").Process(target=edge_process, args=(child,), daemon=True)
    edges.start()
    if CLOUD_CORE in usable_cores():
        pin(CLOUD_CORE)
    if any(settings.get("backend", "").startswith("ray") for _, _, settings in runs):  # its processes on this core
        start_local(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV},
                    logging_level="ERROR")
    out: dict[str, list[dict]] = {label: [] for label, _, _ in runs}
    try:
        for repeat in range(args.repeats):
            for label, n, verifier in runs:
                out[label].append(one_window(conn, target, n, args, **verifier))
                print(f"repeat {repeat + 1}/{args.repeats} {label}: {out[label][-1]['steps']} steps",
                      file=sys.stderr, flush=True)
    finally:
        conn.send(None)
        edges.join(timeout=30)
        ray.shutdown()
        tmp.cleanup()
    return out, {**setting, "load_average": [load_before, os.getloadavg()]}


def interval(values: list[float]) -> list[float]:
    """[mean, and its 95 % interval's low and high end] over the repeats."""
    return [round(x, 4) for x in astuple(mean_ci(values))[:3]]  # value, lo, hi


def host(args) -> dict:
    """Host time per step and per round at each --edges count, the forward pass excluded, part by part."""
    runs = [(f"{b}, B={n}", n, {"backend": b, "hold": Hold(args.hold)}) for n in args.edges for b in args.backends]
    out, setting = windows(args, runs)
    rows = []
    for (n, backend), runs in zip([(n, b) for n in args.edges for b in args.backends], out.values()):
        # What shares the model thread's interpreter: the step's own parts, and grpc or the pipe's ipc.
        host_parts = [p for p in runs[0]["cpu_ms"] if p not in (Part.FORWARD.value, "front_door")]
        per_step = [sum(r["cpu_ms"][p] for p in host_parts) for r in runs]
        rows.append({"edges": n, "backend": backend, "steps": [r["steps"] for r in runs],
                     "rounds_per_step": interval([r["rounds_per_step"] for r in runs]),
                     "host_cpu_ms_per_step": interval(per_step), "reopens": [r["opens"] for r in runs],
                     "tokens_per_s": interval([r["tokens_per_s"] for r in runs]),
                     "host_cpu_us_per_round": interval([1e3 * h * r["steps"] / max(1, r["rounds"]) for h, r in zip(per_step, runs)]),
                     "cpu_ms_per_step": {p: interval([r["cpu_ms"][p] for r in runs]) for p in runs[0]["cpu_ms"]},
                     "wall_ms_per_step": {p: interval([r["wall_ms"][p] for r in runs]) for p in runs[0]["wall_ms"]}})
    return {**setting, "hold": args.hold, "rows": rows}


def meet(args) -> dict:
    """Each --holds policy at each --edges count, in turns; tokens/s also over the first policy's in the same repeat."""
    runs = [(f"{hold}, B={n}", n, {"hold": Hold(hold)}) for n in args.edges for hold in args.holds]
    out, setting = windows(args, runs)
    keys = ("passes_per_round", "rounds_per_step", "hold_ms", "tokens_per_s", "p95_round_ms")
    rows = []
    for label, n, settings in runs:
        first = out[f"{args.holds[0]}, B={n}"]  # the same repeat's run of the first policy: load hits both alike
        rows.append({"hold": settings["hold"].value, "edges": n,
                     **{key: interval([r[key] for r in out[label]]) for key in keys},
                     "tokens_per_s_over_first": interval([r["tokens_per_s"] / f["tokens_per_s"]
                                                          for r, f in zip(out[label], first)])})
    return {**setting, "max_wait_ms": DEFAULT_MAX_WAIT_MS, "rows": rows}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--host", action="store_true", help="a replica's host time per step under many edges")
    parser.add_argument("--meet", action="store_true", help="the batching policies (--holds) under many edges")
    parser.add_argument("--target", default="tiny", help='"tiny" (built from a config) or a model directory')
    parser.add_argument("--rounds", type=int, default=300, help="timed rounds per path")
    parser.add_argument("--pin", action="store_true", help="paths: replicas on the second core, the rest on the first")
    parser.add_argument("--edges", type=lambda s: [int(n) for n in s.split(",")],
                        help="--host, --meet: concurrent edges (sessions), comma-separated (default 1,8,64 and 16,64)")
    parser.add_argument("--holds", type=lambda s: s.split(","), default=[h.value for h in Hold],
                        help="--meet: the batching policies to compare (cloud/core/holding.py)")
    parser.add_argument("--hold", default=DEFAULT_HOLD.value, choices=[h.value for h in Hold],
                        help="--host: the batching policy (quorum and --pass-ms 30: every edge's round in each pass)")
    parser.add_argument("--seconds", type=float, default=5.0, help="--host, --meet: the timed window of each run")
    parser.add_argument("--repeats", type=int, default=3, help="--host, --meet: runs of each setting, in turns")
    parser.add_argument("--draft-ms", type=float, help="--host, --meet: drafting time per round (default 0 and 8)")
    parser.add_argument("--pass-ms", type=float, default=0.0, help="--host, --meet: every pass lasts at least this "
                                                                   "long (a flat-cost device; 0: the target's own)")
    parser.add_argument("--backends", type=lambda s: s.split(","), default=["inprocess"], help="--host: where the "
                        "verifier runs, in turns: inprocess (the front door's process), process (a process of its "
                        "own), apart (that process alone on its core, the front door beside the edges), ray (a Ray "
                        "replica's own process, rounds on its endpoint), ray-actor (the replica actor's)")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    args.draft_ms = args.draft_ms if args.draft_ms is not None else 8.0 if args.meet else 0.0
    args.edges = args.edges or ([16, 64] if args.meet else [1, 8, 64])
    torch.set_num_threads(1)
    result = host(args) if args.host else meet(args) if args.meet else paths(args)
    report({**header(), **result}, args.out, indent=2)


if __name__ == "__main__":
    main()
