"""What TLS and tokens add to a verify round and to opening a connection, four setups in one run.

    python bench/secure_hop.py [--rounds 400] [--connects 40] [--gamma 4] [--target tiny|PATH] [--out FILE]

Four `hybridspec cloud serve --backend inprocess` processes, pinned to the second core (the "cloud
host"), differ only in security: plaintext; TLS; TLS + a bearer token (credentials file, rate limit
on); mutual TLS + token. This process is the "edge host" on the first core, one torch thread, with a
real VerifierClient per setup. Steady state: one session per setup, rounds of γ draft tokens sent
one at a time, the setups taking turns round by round so background noise hits all alike; each
round's time is the client's submit → reply. Connect: a fresh channel (TCP + TLS handshake) and one
OpenSession, `--connects` times per setup, also in turns. Differences are paired (round r of a setup
against round r of plaintext): mean and 95 % t interval, and the medians.
Certificates are throw-away ones from trustme; --target tiny (default) is a random 2-layer Llama
built from a config (lab/tinymodels.py), so the forward pass is short and the hop dominates.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import trustme

from hybridspec.common.security.credentials import add_identity
from hybridspec.common.security.tls import ClientTLS
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import CloudAccess
from harness import (CLOUD_CORE, EDGE_CORE, arguments, median, percentile, start_cloud, stop_cloud, t_interval,
                     tiny_target, write_json)

PROMPT = (5, 17, 33, 80, 41, 9, 120, 77)
MAX_CONTEXT = 512
WARMUP_ROUNDS = 30
SERVER_NAME = "verifier.bench.test"


@dataclass
class Setup:
    """One security setup under test: its server, how an edge connects, what it measured."""

    name: str
    server_keys: dict
    access: CloudAccess
    address: str = ""
    client: VerifierClient | None = None
    session_id: str = ""
    length: int = 0
    round: int = 0
    round_ms: list[float] = field(default_factory=list)
    connect_ms: list[float] = field(default_factory=list)

    def open(self) -> None:
        if self.session_id:
            self.client.close_session(self.session_id)
        opened = self.client.open_session(SessionSpec("", PROMPT))
        self.session_id, self.length, self.round = opened.session_id, opened.committed_len, 0

    def one_round(self, draft: tuple[int, ...], keep: bool) -> None:
        if self.length + len(draft) + 1 >= MAX_CONTEXT:
            self.open()  # untimed: the context is full
        pending = self.client.submit(DraftBlock(self.session_id, self.round, self.length, draft))
        result = self.client.wait(pending)
        self.length, self.round = result.committed_len, self.round + 1
        if keep:
            self.round_ms.append((pending.arrived - pending.sent) * 1e3)

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
        Setup("plaintext", {}, CloudAccess()),
        Setup("tls", tls, CloudAccess(client)),
        Setup("tls+token", {**tls, "credentials": str(credentials)}, CloudAccess(client, token)),
        Setup("mtls+token", {**tls, "tls_client_ca": paths["client_ca"], "credentials": str(credentials)},
              CloudAccess(mutual, token)),
    ]


def paired(setup: list[float], base: list[float]) -> dict:
    """Mean and 95 % t interval of the paired differences setup − base (ms)."""
    diffs = [a - b for a, b in zip(setup, base)]
    mean, half = t_interval(diffs)
    return {"mean_ms": mean, "ci95_ms": half}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--target", default="tiny", help='"tiny" (built from a config) or a model directory')
    parser.add_argument("--rounds", type=int, default=400, help="timed rounds per setup")
    parser.add_argument("--connects", type=int, default=40, help="timed fresh connections per setup")
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    root = Path(tmp.name)
    target = tiny_target(root) if args.target == "tiny" else args.target
    setups = make_setups(root)
    processes = []
    try:
        for setup in setups:
            keys = {"target": target, "backend": "inprocess", "device": "cpu", "torch_threads": 1,
                    "max_context": MAX_CONTEXT, **setup.server_keys}
            proc, setup.address = start_cloud(keys)
            processes.append(proc)
            setup.client = VerifierClient(setup.address, 30, setup.access)
            setup.open()
        draft = tuple(range(10, 10 + args.gamma))
        for r in range(WARMUP_ROUNDS + args.rounds):
            for setup in setups:  # in turns: background load hits every setup alike
                setup.one_round(draft, keep=r >= WARMUP_ROUNDS)
            if r % 100 == 0:
                print(f"round {r}/{WARMUP_ROUNDS + args.rounds}", file=sys.stderr, flush=True)
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
    rows = []
    for setup in setups:
        rows.append({"setup": setup.name, "round_median_ms": median(setup.round_ms),
                     "round_p90_ms": percentile(setup.round_ms, 90),
                     "round_added": paired(setup.round_ms, base.round_ms),
                     "connect_median_ms": median(setup.connect_ms),
                     "connect_added": paired(setup.connect_ms, base.connect_ms)})
    result = {"target": args.target, "gamma": args.gamma, "rounds": args.rounds, "connects": args.connects,
              "edge_core": EDGE_CORE, "cloud_core": CLOUD_CORE, "rows": rows}
    print(f"security cost per round and per connection; target {args.target}, γ = {args.gamma}, {args.rounds} rounds "
          f"and {args.connects} connects per setup, edge on core {EDGE_CORE}, clouds on core {CLOUD_CORE}")
    print(f"{'setup':<11} {'round med':>9} {'p90':>6} {'added (paired mean ± 95%)':>26} {'connect med':>12} "
          f"{'added':>17}  (ms)")
    for row in rows:
        r, c = row["round_added"], row["connect_added"]
        print(f"{row['setup']:<11} {row['round_median_ms']:>9.3f} {row['round_p90_ms']:>6.2f} "
              f"{r['mean_ms']:>+19.3f} ± {r['ci95_ms']:.3f} {row['connect_median_ms']:>12.2f} "
              f"{c['mean_ms']:>+9.2f} ± {c['ci95_ms']:.2f}")
    if args.out:
        write_json(args.out, result, indent=2)


if __name__ == "__main__":
    main()
