"""What the hop edge → verifier → edge costs a round beyond the forward pass: per path (front door, a
replica's own endpoint, in-process), and per security setup (plaintext, TLS, tokens, mutual TLS).

    python bench/hop_overhead.py [--rounds 300] [--gamma 4] [--target tiny|PATH] [--pin] [--out FILE]
    python bench/hop_overhead.py --security [--rounds 400] [--connects 40] [--gamma 4] [--target tiny|PATH] [--out FILE]

Every lane is a real gRPC client (edge/client.py) on localhost sending one round of γ draft tokens at a
time; the lanes take turns round by round, so load from other work on the machine hits all of them
alike. --target tiny (default) is a random 2-layer Llama built from a config (tests/tinymodels.py), so the
forward pass is short and the hop dominates.

Paths (the default), three in one run:
    front-door  the front door routes each round to a 1-replica Ray pool (direct_verify off)
    direct      the edge streams to the replica's own endpoint, named in OpenSessionReply (direct_verify on)
    in-process  the front door runs the verifier itself (inprocess_pool, no Ray): the floor
overhead = client round trip (submit → reply) − the replica's step (VerifyResult.verify_ms − queue_ms,
both set by cloud/core/scheduler.py: the forward pass with its round's admission and rule), with the
configured batching wait (a lone session's round never waits for company): what is left is gRPC, the
front door, Ray and the event-loop and thread hand-offs. --pin puts Ray's processes (the replicas) on
the second core and the front doors and edges on the first.

--security: four `hybridspec cloud serve --backend inprocess` processes on the cloud core differ only in
security: plaintext; TLS; TLS + a bearer token (credentials file, rate limit on); mutual TLS + token.
This process is the edge host on the other core, one torch thread. Each round's time is the client's
submit → reply. Connect: a fresh channel (TCP + TLS handshake) and one OpenSession, `--connects` times
per setup, also in turns. Differences are paired (round r of a setup against round r of plaintext):
mean and 95 % t interval, and the medians. Certificates are throw-away ones from trustme.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import trustme

from hybridspec.cloud.api.server import BackgroundServer, ReplicaEndpoint
from hybridspec.cloud.core.limits import DEFAULT_MAX_WAIT_MS
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.cloud.pool.pool import inprocess_pool
from hybridspec.cloud.pool.cluster import start_local
from hybridspec.cloud.pool.ray_pool import WORKER_ENV, RayPool
from hybridspec.cloud.pool.specs import PoolSettings, PoolSpec, ReplicaSettings, ReplicaSpec
from hybridspec.common.models.loading import load_model
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec
from hybridspec.common.security.credentials import add_identity
from hybridspec.common.security.tls import ClientTLS
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import CloudAccess
from hybridspec.lab.stats import mean_ci
from harness import (CLOUD_CORE, EDGE_CORE, arguments, header, median, percentile, pin, report, start_cloud, stop_cloud,
                     tiny_target, usable_cores)

PROMPT = (5, 17, 33, 80, 41, 9, 120, 77)
LIMITS = VerifierLimits(max_context=512, max_draft=32, max_sessions=8)
WARMUP_ROUNDS = 20
SECURITY_WARMUP_ROUNDS = 30
SERVER_NAME = "verifier.bench.test"


@dataclass
class Lane:
    """One lane under test: its client, its session and what it measured."""

    name: str
    client: VerifierClient | None = None
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


@dataclass
class Setup(Lane):
    """A security setup: its server's keys, how an edge connects, and its connection times too."""

    server_keys: dict = field(default_factory=dict)
    access: CloudAccess = field(default_factory=CloudAccess)
    address: str = ""
    connect_ms: list[float] = field(default_factory=list)

    def one_connect(self) -> None:
        """A new channel, its handshake and one OpenSession, timed; then closed."""
        start = time.perf_counter()
        client = VerifierClient(self.address, 30, self.access)
        opened = client.open_session(SessionSpec("", PROMPT))
        self.connect_ms.append((time.perf_counter() - start) * 1e3)
        client.close_session(opened.session_id)
        client.close()


def make_setups(root: Path) -> list[Setup]:
    """Certificates, a credentials file and the four setups."""
    ca, client_ca = trustme.CA(), trustme.CA()
    server = ca.issue_cert(SERVER_NAME, "127.0.0.1")
    edge = client_ca.issue_cert("edge-1")
    files = {"ca": ca.cert_pem, "client_ca": client_ca.cert_pem, "cert": server.cert_chain_pems[0],
             "key": server.private_key_pem, "edge_cert": edge.cert_chain_pems[0], "edge_key": edge.private_key_pem}
    paths = {}
    for name, blob in files.items():
        blob.write_to_path(str(root / f"{name}.pem"))
        paths[name] = str(root / f"{name}.pem")
    credentials = root / "credentials.yaml"
    token = add_identity(credentials, "bench-edge", max_sessions=64, tokens_per_s=1e9)  # the rate check runs, never binds
    tls = {"tls_cert": paths["cert"], "tls_key": paths["key"]}
    client = ClientTLS(enabled=True, ca=paths["ca"], server_name=SERVER_NAME)
    mutual = ClientTLS(enabled=True, ca=paths["ca"], server_name=SERVER_NAME, cert=paths["edge_cert"],
                       key=paths["edge_key"])
    return [
        Setup("plaintext", server_keys={}, access=CloudAccess()),
        Setup("tls", server_keys=tls, access=CloudAccess(client)),
        Setup("tls+token", server_keys={**tls, "credentials": str(credentials)}, access=CloudAccess(client, token)),
        Setup("mtls+token", server_keys={**tls, "tls_client_ca": paths["client_ca"], "credentials": str(credentials)},
              access=CloudAccess(mutual, token)),
    ]


def paired(setup: list[float], base: list[float]) -> dict:
    """Mean and 95 % t interval of the paired differences setup − base (ms)."""
    estimate = mean_ci([a - b for a, b in zip(setup, base)])
    return {"mean_ms": estimate.value, "ci95_ms": estimate.half_width}


def paths(args) -> dict:
    """The three paths' overhead beyond the forward pass, round by round in turns."""
    cores = usable_cores()
    pinned = args.pin and len(cores) >= 2
    tmp = tempfile.TemporaryDirectory()
    target = tiny_target(Path(tmp.name)) if args.target == "tiny" else args.target
    if pinned:
        pin(cores[1])  # Ray's processes, replicas included, inherit this core
    start_local(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV},
                logging_level="ERROR")
    servers = {}
    for name, endpoint in (("front-door", None), ("direct", ReplicaEndpoint("127.0.0.1"))):
        settings = ReplicaSettings(device="cpu", torch_threads=1, max_wait_ms=args.max_wait_ms)
        pool = RayPool(PoolSpec(ReplicaSpec(target, settings, LIMITS), PoolSettings(replicas=1), name=f"hop-{name}"),
                       endpoint)
        servers[name] = BackgroundServer(pool)
    if pinned:
        pin(cores[0])  # the front doors' loops, the in-process verifier and the edges
    verifier = Verifier(load_model(target, device="cpu"), LIMITS, max_wait_ms=args.max_wait_ms)
    servers["in-process"] = BackgroundServer(inprocess_pool(verifier))
    lanes = [Lane(name, VerifierClient(server.address)) for name, server in servers.items()]
    draft = tuple(range(10, 10 + args.gamma))
    try:
        for lane in lanes:
            lane.open()
        assert [p.direct for p in lanes] == [False, True, False], "only the direct path should name an endpoint"
        for r in range(WARMUP_ROUNDS + args.rounds):
            for lane in lanes:  # round-robin: background load hits every path alike
                lane.one_round(draft, keep=r >= WARMUP_ROUNDS)
    finally:
        for lane in lanes:
            lane.client.close()
        for server in servers.values():
            server.stop()
        import ray

        ray.shutdown()
        tmp.cleanup()

    rows = [{"path": p.name, "overhead_median_ms": median(p.overhead_ms), "overhead_p90_ms": percentile(p.overhead_ms, 90),
             "rtt_median_ms": median(p.rtt_ms), "forward_median_ms": median(p.forward_ms),
             "queue_median_ms": median(p.queue_ms)} for p in lanes]
    return {"target": args.target, "gamma": args.gamma, "rounds": args.rounds, "max_wait_ms": args.max_wait_ms,
            "pinned": pinned, "cores": len(cores), "rows": rows}


def security(args) -> dict:
    """The four security setups' round and connection times, paired against plaintext."""
    tmp = tempfile.TemporaryDirectory()
    root = Path(tmp.name)
    target = tiny_target(root) if args.target == "tiny" else args.target
    setups = make_setups(root)
    processes = []
    try:
        for setup in setups:
            keys = {"target": target, "backend": "inprocess", "device": "cpu", "torch_threads": 1,
                    "max_context": LIMITS.max_context, **setup.server_keys}
            proc, setup.address = start_cloud(keys)
            processes.append(proc)
            setup.client = VerifierClient(setup.address, 30, setup.access)
            setup.open()
        draft = tuple(range(10, 10 + args.gamma))
        for r in range(SECURITY_WARMUP_ROUNDS + args.rounds):
            for setup in setups:  # in turns: background load hits every setup alike
                setup.one_round(draft, keep=r >= SECURITY_WARMUP_ROUNDS)
            if r % 100 == 0:
                print(f"round {r}/{SECURITY_WARMUP_ROUNDS + args.rounds}", file=sys.stderr, flush=True)
        for setup in setups:
            setup.one_connect()  # warm-up, untimed
            setup.connect_ms.clear()
        for _ in range(args.connects):
            for setup in setups:
                setup.one_connect()
    finally:
        for setup in setups:
            if setup.client is not None:
                setup.client.close()
        for proc in processes:
            stop_cloud(proc)
        tmp.cleanup()

    base = setups[0]
    rows = [{"setup": setup.name, "round_median_ms": median(setup.rtt_ms), "round_p90_ms": percentile(setup.rtt_ms, 90),
             "round_added": paired(setup.rtt_ms, base.rtt_ms), "connect_median_ms": median(setup.connect_ms),
             "connect_added": paired(setup.connect_ms, base.connect_ms)} for setup in setups]
    return {"target": args.target, "gamma": args.gamma, "rounds": args.rounds, "connects": args.connects,
            "edge_core": EDGE_CORE, "cloud_core": CLOUD_CORE, "rows": rows}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--security", action="store_true", help="the four security setups instead of the paths")
    parser.add_argument("--target", default="tiny", help='"tiny" (built from a config) or a model directory')
    parser.add_argument("--rounds", type=int, help="timed rounds per lane (default: 300 per path, 400 per setup)")
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--max-wait-ms", type=float, default=DEFAULT_MAX_WAIT_MS,
                        help="paths: the scheduler's wait for recently active sessions' rounds")
    parser.add_argument("--pin", action="store_true", help="paths: replicas on the second core, the rest on the first")
    parser.add_argument("--connects", type=int, default=40, help="--security: timed fresh connections per setup")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    args.rounds = args.rounds or (400 if args.security else 300)
    torch.set_num_threads(1)
    result = security(args) if args.security else paths(args)
    report({**header(), **result}, args.out, indent=2)


if __name__ == "__main__":
    main()
