"""Does a refused message ever leave a stream waiting? Shared VerifyStreams mixing valid and refused
messages, for minutes, against a real front door.

    python bench/refusal_soak.py [--minutes 10] [--streams 8] [--backend inprocess|ray] [--out FILE.json]

`cloud serve` runs the tiny random target (fast rounds, so many messages) on one core; `--streams`
client threads on the other each keep two sessions and open VerifyStream after VerifyStream, sending
valid rounds of both sessions (back to back, several before the first reply) and, at a random point,
one refused message — a wrong committed length, a wrong round, an out-of-vocabulary draft, an unknown
or over-long session id, another thread's session, an undecodable body — sometimes followed by more
messages, a half-close or a cancel. Every call must end (a reply per valid message before the refused
one, then the refusal's status) within `--stall-s`; a call that does not is a stall, recorded with the
messages it sent. The client deadline is 30 s, as the edge's.
"""
from __future__ import annotations

import argparse
import collections
import json
import queue
import random
import tempfile
import threading
import time
from pathlib import Path

import grpc

from hybridspec.cloud.process import start_cloud_process, stop_cloud_process
from hybridspec.common.protocol.proto import verifier_pb2 as pb
from harness import pin, tests_module, tiny_target, usable_cores, write_json

VOCAB = tests_module("tinymodels").VOCAB  # the tiny target's vocabulary: ids past it are refused

METHOD = "/hybridspec.v1.Verifier/VerifyStream"
PROMPT = [5, 6, 7, 8]
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
        sid = self.open(pb.OpenSessionRequest(committed_ids=PROMPT), timeout=30).session_id
        self.shared["sessions"].append(sid)
        return {"id": sid, "round": 0, "length": len(PROMPT)}

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=8, help="client threads, each with its own streams")
    parser.add_argument("--backend", choices=["inprocess", "ray"], default="inprocess")
    parser.add_argument("--stall-s", type=float, default=5.0, help="a call still open after this long is a stall")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cores = usable_cores()
    target = tiny_target(Path(tempfile.mkdtemp()))
    keys = {"target": str(target), "backend": args.backend, "torch_threads": 1, "max_context": 4096,
            "max_sessions": 8 * args.streams, "max_sessions_per_address": 8 * args.streams,
            "max_calls_per_address": 8 * args.streams, "direct_verify": False}
    if args.backend == "ray":
        keys.update({"replica_num_cpus": 0.5, "ray_num_cpus": 2})
    proc, address, log = start_cloud_process(keys, {cores[0]} if len(cores) > 1 else None)
    if len(cores) > 1:
        pin(cores[1:])
    print(f"cloud serve at {address} (log {log})", flush=True)
    codes: collections.Counter = collections.Counter()
    stalls, anomalies, seconds, lock = [], [], [], threading.Lock()
    deadline = time.monotonic() + 60 * args.minutes
    shared = {"sessions": []}

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
    try:
        while any(t.is_alive() for t in threads):
            time.sleep(15)
            with lock:
                print(f"{sum(codes.values())} calls, {len(stalls)} stalls, {len(anomalies)} anomalies, {dict(codes)}",
                      flush=True)
    finally:
        stop_cloud_process(proc)
    seconds.sort()
    summary = {"backend": args.backend, "minutes": args.minutes, "streams": args.streams, "calls": sum(codes.values()),
               "codes": dict(codes), "stalls": len(stalls), "stall_examples": stalls[:10],
               "anomalies": len(anomalies), "anomaly_examples": anomalies[:10],
               "call_s_p50": round(seconds[len(seconds) // 2], 4), "call_s_p99": round(seconds[int(0.99 * len(seconds))], 4),
               "call_s_max": round(seconds[-1], 4)}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, summary)


if __name__ == "__main__":
    main()
