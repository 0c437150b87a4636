"""Can idle streams lock token holders out? A victim's latency while a flood holds calls open.

    python bench/lockout_probe.py [--flood 1100] [--rounds 40] [--out docs/integrity/lockout.json]

`cloud serve --credentials` (in-process backend, the embedded target, one torch thread) runs on one
core; on the other, a flood opens `--flood` VerifyStream calls that never send a message, and then a
victim with a valid token opens a session and sends `--rounds` rounds (γ = 4 drafts) on one stream.
Three floods, each against a fresh server: none, anonymous (no token), and one valid token
(another identity's). Reported per flood: how its calls ended within 2 s (status counts; "open"
means still held) and the victim's outcome: its open, its round latency p50/p90/max, or the error
that refused it.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import tempfile
import threading
import time
from pathlib import Path

import grpc

from hybridspec.cloud.process import start_cloud_process, stop_cloud_process
from hybridspec.common.security.credentials import add_identity
from hybridspec.common.protocol.proto import verifier_pb2 as pb
from hybridspec.common.protocol.proto import verifier_pb2_grpc as pb_grpc
from harness import median, percentile, pin, usable_cores, write_json

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", type=int, default=1100, help="silent streams per flood")
    parser.add_argument("--rounds", type=int, default=40, help="victim rounds per flood")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    cores = usable_cores()
    credentials = Path(tempfile.mkdtemp()) / "credentials.yaml"
    tokens = {name: add_identity(credentials, name) for name in ("victim", "flooder")}
    results = []
    for flood_kind in ("none", "anonymous", "one token"):
        proc, address, log = start_cloud_process(
            {"backend": "inprocess", "torch_threads": 1, "credentials": str(credentials)},
            cores={cores[0]} if len(cores) > 1 else None)
        if len(cores) > 1:
            pin(cores[1:])
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
            stop_cloud_process(proc)
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, {"flood": args.flood, "rounds": args.rounds, "results": results})


if __name__ == "__main__":
    main()
