"""Does a stream ever wait for nothing? Two probes of the front door's streams, each against a real
`cloud serve` on one core with the clients on the other.

    python bench/stalls.py refusals [--minutes 10] [--streams 8] [--backend inprocess|ray] [--out FILE.json]
    python bench/stalls.py lockout [--flood 1100] [--rounds 40] [--out docs/integrity/lockout.json]

refusals: shared VerifyStreams mixing valid and refused messages, for minutes. `cloud serve` runs the
tiny random target (fast rounds, so many messages); `--streams` client threads each keep two sessions
and open VerifyStream after VerifyStream, sending valid rounds of both sessions (back to back, several
before the first reply) and, at a random point, one refused message — a wrong committed length, a wrong
round, an out-of-vocabulary draft, an unknown or over-long session id, another thread's session, an
undecodable body — sometimes followed by more messages, a half-close or a cancel. Every call must end
(a reply per valid message before the refused one, then the refusal's status) within `--stall-s`; a call
that does not is a stall, recorded with the messages it sent. The client deadline is 30 s, as the edge's.

lockout: can idle streams lock token holders out? `cloud serve --credentials` (in-process backend, the
embedded target, one torch thread); a flood opens `--flood` VerifyStream calls that never send a
message, and then a victim with a valid token opens a session and sends `--rounds` rounds (γ = 4
drafts) on one stream. Three floods, each against a fresh server: none, anonymous (no token), and one
valid token (another identity's). Reported per flood: how its calls ended within 2 s (status counts;
"open" means still held) and the victim's outcome: its open, its round latency p50/p90/max, or the
error that refused it.
"""
from __future__ import annotations

import asyncio
import collections
import json
import queue
import random
import tempfile
import threading
import time
from pathlib import Path

import grpc

from hybridspec.common.protocol.proto import verifier_pb2 as pb
from hybridspec.common.protocol.proto import verifier_pb2_grpc as pb_grpc
from hybridspec.common.security.credentials import add_identity
from hybridspec.lab.tinymodels import VOCAB  # the tiny target's vocabulary: ids past it are refused
from harness import arguments, cloud, median, percentile, report, tiny_target

METHOD = "/hybridspec.v1.Verifier/VerifyStream"
TINY_PROMPT = [5, 6, 7, 8]
REFUSALS = ("committed_len", "round", "out_of_vocabulary", "unknown_session", "long_session_id", "foreign_session",
            "undecodable")
AFTER = ("nothing", "more_messages", "half_close", "cancel")
_END = object()


class Client:
    """One thread's two sessions and the calls it makes."""

    def __init__(self, channel: grpc.Channel, rng: random.Random, stall_s: float, shared: dict) -> None:
        self.rng, self.stall_s, self.shared = rng, stall_s, shared
        self.open = channel.unary_unary("/hybridspec.v1.Verifier/OpenSession",
                                        request_serializer=pb.OpenSessionRequest.SerializeToString,
                                        response_deserializer=pb.OpenSessionReply.FromString)
        self.stream = channel.stream_stream(METHOD, request_serializer=lambda b: b,
                                            response_deserializer=pb.VerifyReply.FromString)
        self.close = channel.unary_unary("/hybridspec.v1.Verifier/CloseSession",
                                         request_serializer=pb.CloseSessionRequest.SerializeToString,
                                         response_deserializer=pb.CloseSessionReply.FromString)
        self.sessions = [self._open() for _ in range(2)]

    def renew(self) -> None:
        """Close both sessions and open two new ones."""
        old, self.sessions = self.sessions, []
        for s in old:
            if s["id"] in self.shared["sessions"]:
                self.shared["sessions"].remove(s["id"])
            self.close(pb.CloseSessionRequest(session_id=s["id"]), timeout=30)
        self.sessions = [self._open() for _ in range(2)]

    def _open(self) -> dict:
        sid = self.open(pb.OpenSessionRequest(committed_ids=TINY_PROMPT), timeout=30).session_id
        self.shared["sessions"].append(sid)
        return {"id": sid, "round": 0, "length": len(TINY_PROMPT)}

    def valid(self, s: dict, round_offset: int = 0) -> pb.VerifyRequest:
        draft = [self.rng.randrange(4, VOCAB) for _ in range(self.rng.randint(0, 4))]
        return pb.VerifyRequest(session_id=s["id"], round=s["round"] + round_offset, committed_len=s["length"],
                                draft_ids=draft)

    def refused(self, kind: str) -> bytes:
        s = self.rng.choice(self.sessions)
        base = dict(session_id=s["id"], round=s["round"], committed_len=s["length"])
        if kind == "committed_len":
            base["committed_len"] += self.rng.randint(1, 50)
        elif kind == "round":
            base["round"] += self.rng.randint(2, 9)
        elif kind == "out_of_vocabulary":
            return pb.VerifyRequest(**base, draft_ids=[4, VOCAB + self.rng.randrange(1000)]).SerializeToString()
        elif kind == "unknown_session":
            base["session_id"] = f"nobody-{self.rng.randrange(10**9)}"
        elif kind == "long_session_id":
            base["session_id"] = "x" * 9000
        elif kind == "foreign_session":  # a round no session is at: refused, never applied to the other's
            base.update(session_id=self.rng.choice(self.shared["sessions"]), round=10**6)
        else:
            return b"\x0a\xff\xff"
        return pb.VerifyRequest(**base).SerializeToString()

    def call(self) -> dict:
        """One VerifyStream: a valid round of each of 0-2 sessions sent back to back, maybe a refusal,
        then an ending."""
        requests: queue.Queue = queue.Queue()
        plan = self.rng.sample(self.sessions, self.rng.randint(0, 2))
        refusal = self.rng.choice(REFUSALS) if self.rng.random() < 0.8 else None
        after = self.rng.choice(AFTER)
        call = self.stream(iter(requests.get, _END), timeout=30)
        started = time.perf_counter()
        sent = []
        for s in plan:
            requests.put(self.valid(s).SerializeToString())
            sent.append(f"valid {s['id'][:6]} round {s['round']}")
        if refusal is not None:
            requests.put(self.refused(refusal))
            sent.append(f"refused: {refusal}")
            if after == "more_messages":
                for _ in range(self.rng.randint(1, 3)):
                    requests.put(self.valid(self.rng.choice(self.sessions)).SerializeToString())
                    sent.append("valid after the refusal")
        if after == "half_close" or refusal is None:
            requests.put(_END)
        outcome: dict = {"sent": sent, "after": after}
        watchdog = threading.Timer(self.stall_s, lambda: outcome.setdefault("stalled_after_s", self.stall_s))
        watchdog.start()
        replies = []
        try:
            if after == "cancel" and refusal is not None:
                time.sleep(self.rng.random() * 0.01)
                call.cancel()
            for reply in call:
                replies.append(reply)
            outcome["code"] = "OK"
        except grpc.RpcError as exc:
            outcome["code"] = exc.code().name
        finally:
            watchdog.cancel()
            requests.put(_END)
        outcome["seconds"] = time.perf_counter() - started
        for reply, s in zip(replies, plan):  # answered rounds advance their sessions
            s["round"], s["length"] = reply.round + 1, reply.committed_len
        if refusal is None and outcome["code"] != "OK" or len(replies) > len(plan):
            outcome["anomaly"] = True  # a valid call refused, or a refused message answered
        if outcome["code"] == "CANCELLED" or outcome.get("anomaly"):
            # Rounds may have committed without their replies reaching us: start afresh, as an edge re-opens.
            self.renew()
        return outcome


PROMPT = [1, 9690, 198, 3303, 314, 260, 6917, 2840, 47, 2]
DRAFT = [30, 31, 32, 33]
STREAMS_PER_CHANNEL = 100  # a flood spreads over connections, as many clients would


class Flood:
    """`count` silent VerifyStream calls held open from an asyncio client on its own thread."""

    def __init__(self, address: str, count: int, token: str | None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._calls, self._channels = self._run(self._open(address, count, metadata), 120)

    def _run(self, coro, timeout_s: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    async def _open(self, address, count, metadata):
        channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(max(1, -(-count // STREAMS_PER_CHANNEL)))]
        calls = [pb_grpc.VerifierStub(channels[i % len(channels)]).VerifyStream(metadata=metadata)
                 for i in range(count)]
        return calls, channels

    def outcome(self) -> dict[str, int]:
        """How the calls stand now: status names, 'open' for those still held."""
        async def codes():
            return collections.Counter([(await c.code()).name if c.done() else "open" for c in self._calls])

        return dict(self._run(codes(), 60))

    def close(self) -> None:
        async def end():
            for call in self._calls:
                call.cancel()
            for channel in self._channels:
                await channel.close()

        self._run(end(), 60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


def victim(address: str, token: str, rounds: int) -> dict:
    """Open, `rounds` rounds on one stream, close; latencies or the refusal."""
    metadata = (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        try:
            t0 = time.perf_counter()
            sid = stub.OpenSession(pb.OpenSessionRequest(committed_ids=PROMPT), metadata=metadata,
                                   timeout=30).session_id
            open_ms = 1e3 * (time.perf_counter() - t0)
            sent: list[float] = []
            latencies: list[float] = []
            length = len(PROMPT)
            replies = queue_requests(sid, length, rounds, sent)
            call = stub.VerifyStream(replies.requests(), metadata=metadata, timeout=120)
            for reply in call:
                latencies.append(1e3 * (time.perf_counter() - sent[reply.round]))
                replies.answer(reply.committed_len)
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=metadata, timeout=30)
        except grpc.RpcError as exc:
            return {"served": False, "error": f"{exc.code().name}: {exc.details()}"}
    return {"served": True, "open_ms": round(open_ms, 1), "rounds": len(latencies),
            "round_ms_p50": round(median(latencies), 1), "round_ms_p90": round(percentile(latencies, 90), 1),
            "round_ms_max": round(max(latencies), 1)}


class queue_requests:
    """Requests sent one at a time, each after the previous reply (an edge without pipelining)."""

    def __init__(self, sid: str, length: int, rounds: int, sent: list[float]) -> None:
        self.sid, self.length, self.rounds, self.sent = sid, length, rounds, sent
        self._next = threading.Semaphore(1)

    def requests(self):
        for r in range(self.rounds):
            self._next.acquire()
            self.sent.append(time.perf_counter())
            yield pb.VerifyRequest(session_id=self.sid, round=r, committed_len=self.length, draft_ids=DRAFT)

    def answer(self, committed_len: int) -> None:
        self.length = committed_len
        self._next.release()


def refusals(args) -> dict:
    """`args.streams` threads of mixed valid and refused calls for `args.minutes`; the calls' outcomes."""
    target = tiny_target(Path(tempfile.mkdtemp()))
    keys = {"target": str(target), "backend": args.backend, "torch_threads": 1, "max_context": 4096,
            "max_sessions": 8 * args.streams, "max_sessions_per_address": 8 * args.streams,
            "max_calls_per_address": 8 * args.streams, "direct_verify": False}
    if args.backend == "ray":
        keys.update({"replica_num_cpus": 0.5, "ray_num_cpus": 2})
    codes: collections.Counter = collections.Counter()
    stalls, anomalies, seconds, lock = [], [], [], threading.Lock()
    shared = {"sessions": []}
    with cloud(keys) as (_, address):
        deadline = time.monotonic() + 60 * args.minutes

        def worker(i: int) -> None:
            rng = random.Random(args.seed * 1000 + i)
            with grpc.insecure_channel(address) as channel:
                client = Client(channel, rng, args.stall_s, shared)
                while time.monotonic() < deadline:
                    try:
                        outcome = client.call()
                    except grpc.RpcError as exc:  # an open or close refused: recorded, and the thread goes on
                        outcome = {"code": f"bookkeeping {exc.code().name}", "seconds": 0.0, "anomaly": True,
                                   "details": exc.details()}
                    with lock:
                        codes[outcome["code"]] += 1
                        seconds.append(outcome["seconds"])
                        if "stalled_after_s" in outcome:
                            stalls.append(outcome)
                        if outcome.get("anomaly"):
                            anomalies.append(outcome)

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.streams)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(15)
            with lock:
                print(f"{sum(codes.values())} calls, {len(stalls)} stalls, {len(anomalies)} anomalies, {dict(codes)}",
                      flush=True)
    seconds.sort()
    return {"backend": args.backend, "minutes": args.minutes, "streams": args.streams, "calls": sum(codes.values()),
            "codes": dict(codes), "stalls": len(stalls), "stall_examples": stalls[:10],
            "anomalies": len(anomalies), "anomaly_examples": anomalies[:10],
            "call_s_p50": round(seconds[len(seconds) // 2], 4),
            "call_s_p99": round(seconds[int(0.99 * len(seconds))], 4), "call_s_max": round(seconds[-1], 4)}


def lockout(args) -> dict:
    """The victim's rounds under no flood, an anonymous flood and a one-token flood."""
    credentials = Path(tempfile.mkdtemp()) / "credentials.yaml"
    tokens = {name: add_identity(credentials, name) for name in ("victim", "flooder")}
    results = []
    for flood_kind in ("none", "anonymous", "one token"):
        with cloud({"backend": "inprocess", "torch_threads": 1, "credentials": str(credentials)}) as (_, address):
            flood = None
            try:
                victim(address, tokens["victim"], 3)  # warm the model
                if flood_kind != "none":
                    flood = Flood(address, args.flood, tokens["flooder"] if flood_kind == "one token" else None)
                    time.sleep(2.0)
                row = {"flood": flood_kind, "flood_calls": 0 if flood is None else args.flood,
                       "flood_outcome": {} if flood is None else flood.outcome(),
                       "victim": victim(address, tokens["victim"], args.rounds)}
            finally:
                if flood is not None:
                    flood.close()
        print(json.dumps(row), flush=True)
        results.append(row)
    return {"flood": args.flood, "rounds": args.rounds, "results": results}


def main() -> None:
    parser = arguments(__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    mixed = commands.add_parser("refusals", help="minutes of valid and refused messages on shared streams")
    mixed.add_argument("--minutes", type=float, default=10.0)
    mixed.add_argument("--streams", type=int, default=8, help="client threads, each with its own streams")
    mixed.add_argument("--backend", choices=["inprocess", "ray"], default="inprocess")
    mixed.add_argument("--stall-s", type=float, default=5.0, help="a call still open after this long is a stall")
    mixed.add_argument("--seed", type=int, default=0)
    flood = commands.add_parser("lockout", help="a token holder's rounds while silent streams flood the door")
    flood.add_argument("--flood", type=int, default=1100, help="silent streams per flood")
    flood.add_argument("--rounds", type=int, default=40, help="victim rounds per flood")
    for command in (mixed, flood):
        command.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    report(refusals(args) if args.command == "refusals" else lockout(args), args.out)


if __name__ == "__main__":
    main()
