"""Per-round overhead of the hop edge → verifier → edge beyond the forward pass, for three paths in one run.

    python bench/hop_overhead.py [--rounds 300] [--gamma 4] [--target tiny|PATH] [--pin] [--out FILE]

Paths, each a real gRPC client (edge/client.py) on localhost sending one round at a time:
    front-door  the front door routes each round to a 1-replica Ray pool (direct_verify off)
    direct      the edge streams to the replica's own endpoint, named in OpenSessionReply (direct_verify on)
    in-process  the front door runs the verifier itself (InProcessBackend, no Ray): the floor
overhead = client round trip (submit → reply) − the replica's step (VerifyResult.verify_ms − queue_ms,
both set by cloud/core/scheduler.py: the forward pass with its round's admission and rule), with the
configured batching wait (a lone session's round never waits for company): what is left is gRPC, the
front door, Ray and the event-loop and thread hand-offs.
The paths take turns round by round, so load from other work on the machine hits all of them alike.
--target tiny (default) is a random 2-layer Llama built from a config (lab/tinymodels.py);
--pin puts Ray's processes (the replicas) on the second core and the front doors and edges on the first.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridspec.cloud.pool.backend import InProcessBackend
from hybridspec.cloud.pool.cluster import start_local
from hybridspec.cloud.pool.ray_pool import WORKER_ENV, RayPool
from hybridspec.cloud.pool.specs import PoolSpec, ReplicaSpec
from hybridspec.cloud.core.scheduler import DEFAULT_MAX_WAIT_MS
from hybridspec.cloud.api.server import BackgroundServer, ReplicaEndpoint
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.common.models.loading import load_model
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec
from hybridspec.edge.client import VerifierClient
from harness import arguments, median, percentile, pin, tiny_target, usable_cores, write_json

PROMPT = (5, 17, 33, 80, 41, 9, 120, 77)
LIMITS = VerifierLimits(max_context=512, max_draft=32, max_sessions=8)
WARMUP_ROUNDS = 20


@dataclass
class Lane:
    """One path under test: its client, its session and what it measured."""

    name: str
    client: VerifierClient
    session_id: str = ""
    length: int = 0
    round: int = 0
    direct: bool = False  # rounds go to a replica's own endpoint
    overhead_ms: list[float] = field(default_factory=list)
    rtt_ms: list[float] = field(default_factory=list)
    forward_ms: list[float] = field(default_factory=list)
    queue_ms: list[float] = field(default_factory=list)

    def open(self) -> None:
        """A fresh session (untimed): rounds of a fixed block grow the context until it must be renewed."""
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
            rtt = (pending.arrived - pending.sent) * 1e3
            forward = result.verify_ms - result.queue_ms
            self.rtt_ms.append(rtt)
            self.forward_ms.append(forward)
            self.queue_ms.append(result.queue_ms)
            self.overhead_ms.append(rtt - forward)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--target", default="tiny", help='"tiny" (built from a config) or a model directory')
    parser.add_argument("--rounds", type=int, default=300, help="timed rounds per path")
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--max-wait-ms", type=float, default=DEFAULT_MAX_WAIT_MS,
                        help="the scheduler's wait for recently active sessions' rounds")
    parser.add_argument("--pin", action="store_true", help="replicas on the second core, the rest on the first")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    cores = usable_cores()
    pinned = args.pin and len(cores) >= 2
    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory()
    target = tiny_target(Path(tmp.name)) if args.target == "tiny" else args.target

    if pinned:
        pin(cores[1])  # Ray's processes, replicas included, inherit this core
    start_local(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV},
                logging_level="ERROR")
    servers = {}
    for name, endpoint in (("front-door", None), ("direct", ReplicaEndpoint("127.0.0.1"))):
        spec = ReplicaSpec(target=target, device="cpu", torch_threads=1, limits=LIMITS, max_wait_ms=args.max_wait_ms)
        pool = RayPool(PoolSpec(replica=spec, replicas=1, num_cpus=1, name=f"hop-{name}"), endpoint)
        servers[name] = BackgroundServer(pool)
    if pinned:
        pin(cores[0])  # the front doors' loops, the in-process verifier and the edges
    verifier = Verifier(load_model(target, device="cpu"), LIMITS)
    servers["in-process"] = BackgroundServer(InProcessBackend(verifier, max_wait_ms=args.max_wait_ms))
    paths = [Lane(name, VerifierClient(server.address)) for name, server in servers.items()]
    draft = tuple(range(10, 10 + args.gamma))
    try:
        for path in paths:
            path.open()
        assert [p.direct for p in paths] == [False, True, False], "only the direct path should name an endpoint"
        for r in range(WARMUP_ROUNDS + args.rounds):
            for path in paths:  # round-robin: background load hits every path alike
                path.one_round(draft, keep=r >= WARMUP_ROUNDS)
    finally:
        for path in paths:
            path.client.close()
        for server in servers.values():
            server.stop()
        import ray

        ray.shutdown()
        tmp.cleanup()

    rows = [{"path": p.name, "overhead_median_ms": median(p.overhead_ms), "overhead_p90_ms": percentile(p.overhead_ms, 90),
             "rtt_median_ms": median(p.rtt_ms), "forward_median_ms": median(p.forward_ms),
             "queue_median_ms": median(p.queue_ms)} for p in paths]
    result = {"target": args.target, "gamma": args.gamma, "rounds": args.rounds, "max_wait_ms": args.max_wait_ms,
              "pinned": pinned, "cores": len(cores), "rows": rows}
    print(f"per-round overhead beyond the forward pass; target {args.target}, γ = {args.gamma}, {args.rounds} rounds "
          f"per path, max_wait_ms {args.max_wait_ms:g}, {'pinned' if pinned else 'not pinned'}, {len(cores)} cores")
    print(f"{'path':<12} {'overhead med':>12} {'p90':>7} {'rtt med':>8} {'forward':>8} {'queue':>6}  (ms)")
    for row in rows:
        print(f"{row['path']:<12} {row['overhead_median_ms']:>12.2f} {row['overhead_p90_ms']:>7.2f} "
              f"{row['rtt_median_ms']:>8.2f} {row['forward_median_ms']:>8.2f} {row['queue_median_ms']:>6.2f}")
    if args.out:
        write_json(args.out, result, indent=2)


if __name__ == "__main__":
    main()
