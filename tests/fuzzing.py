"""Hostile and buggy messages for every Verifier RPC, as hypothesis strategies, and the rule they
must obey: every reply is OK or a documented client-error status with a short message.

Shared by tests/test_fuzz.py (a few hundred cases in CI) and `bench/soak.py fuzz` (10^4 and more).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import grpc
from hypothesis import strategies as st

from hybridspec.common.protocol.proto import verifier_pb2 as pb
from hybridspec.common.protocol.proto import verifier_pb2_grpc as pb_grpc

# What a bad or unlucky request may earn. UNKNOWN and INTERNAL never: they mean a server bug.
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
MAX_DETAILS_CHARS = 300  # an error message names the problem in a line, never a traceback
MAX_LIVE = 12  # live sessions a fuzzer keeps to aim at
METHODS = ("GetModelInfo", "OpenSession", "OpenSessionStream", "Verify", "VerifyStream", "CloseSession", "Generate")
SERVER_STREAMS = ("Generate", "OpenSessionStream")

UINT32 = 2**32 - 1
# Ids cluster around the vocabulary edge of the tiny (256) and real (49152) targets.
token_ids = st.one_of(st.integers(0, 300), st.integers(49_000, 49_300), st.integers(0, UINT32))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.sampled_from([0.0, -0.0, 1e-40, 1e-3, 0.5, 1.0, 1.5, 1e38]))
text = st.text(max_size=80)


@st.composite
def session_ids(draw, live: list[str]) -> str:
    """Half the time the id of a live session (so the deeper checks run), else anything. The same
    draws happen whatever `live` holds, as hypothesis needs of a strategy."""
    pick_live = draw(st.booleans())
    index = draw(st.integers(0, MAX_LIVE - 1))
    other = draw(st.one_of(text, st.just(""), st.text(min_size=60, max_size=70)))
    return live[index % len(live)] if pick_live and live else other


def sampling() -> st.SearchStrategy:
    return st.builds(pb.SamplingParams, temperature=floats, top_k=st.integers(0, UINT32), top_p=floats)


def open_requests(live: list[str]) -> st.SearchStrategy:
    return st.builds(
        pb.OpenSessionRequest, session_id=session_ids(live), committed_ids=st.lists(token_ids, max_size=40),
        sampling=sampling(), mode=st.integers(0, 6), seed=st.integers(0, 2**64 - 1), rollback_threshold=floats,
        lenience=floats, tokenizer_fingerprint=st.one_of(st.just(""), text), next_round=st.integers(0, UINT32),
        model_fingerprint=st.one_of(st.just(""), text))


def draft_positions() -> st.SearchStrategy:
    return st.builds(pb.DraftPosition, support_ids=st.lists(token_ids, max_size=6),
                     probs=st.lists(floats, max_size=6))


def verify_requests(live: list[str]) -> st.SearchStrategy:
    return st.builds(
        pb.VerifyRequest, session_id=session_ids(live), round=st.one_of(st.integers(0, 8), st.integers(0, UINT32)),
        committed_len=st.one_of(st.integers(0, 60), st.integers(0, UINT32)),
        draft_ids=st.lists(token_ids, max_size=40), draft_probs=st.lists(draft_positions(), max_size=6))


def generate_requests() -> st.SearchStrategy:
    return st.builds(pb.GenerateRequest, prompt_ids=st.lists(token_ids, max_size=20), sampling=sampling(),
                     # Small, or beyond any max_context: a valid long generation is a user's right, and
                     # would only measure how long the fuzzer waits.
                     max_new_tokens=st.one_of(st.integers(0, 4), st.integers(10**6, UINT32)),
                     seed=st.integers(0, 2**64 - 1), tokenizer_fingerprint=st.one_of(st.just(""), text))


def plausible_opens() -> st.SearchStrategy:
    """New sessions a real edge would open: in-vocabulary prompts, greedy or sampled."""
    return st.builds(pb.OpenSessionRequest, committed_ids=st.lists(st.integers(4, 255), min_size=1, max_size=30),
                     sampling=st.builds(pb.SamplingParams, temperature=st.sampled_from([0.0, 0.0, 0.7, 1.0]),
                                        top_k=st.sampled_from([0, 0, 5]), top_p=st.sampled_from([1.0, 0.9])))


@st.composite
def plausible_verifies(draw, sessions: dict[str, list]) -> pb.VerifyRequest:
    """Rounds aimed at a live session: mostly its next round and length, sometimes off by one, with a
    well-formed (occasionally corrupted) q where its mode needs one. Same draws whatever the state."""
    index = draw(st.integers(0, MAX_LIVE - 1))
    round_off, len_off = draw(st.sampled_from([0, 0, 0, 0, -1, 1])), draw(st.sampled_from([0, 0, 0, 0, -1, 1]))
    draft = draw(st.lists(st.integers(4, 255), max_size=6))
    others = draw(st.lists(st.lists(st.integers(4, 255), max_size=3), min_size=6, max_size=6))
    weights = draw(st.lists(st.lists(st.floats(0.01, 1.0), min_size=4, max_size=4), min_size=6, max_size=6))
    corrupt = draw(st.sampled_from([False] * 5 + [True]))
    ids = list(sessions)
    if not ids:
        return pb.VerifyRequest(session_id="", draft_ids=draft)
    sid = ids[index % len(ids)]
    next_round, committed_len, needs_probs = sessions[sid]
    positions = []
    for x, extra, w in zip(draft, others, weights) if needs_probs else ():
        support = list(dict.fromkeys([x, *extra]))
        total = sum(w[:len(support)])
        positions.append(pb.DraftPosition(support_ids=support, probs=[v / total for v in w[:len(support)]]))
    if corrupt and positions:
        positions[-1].probs[0] *= 3.0
    return pb.VerifyRequest(session_id=sid, round=max(0, next_round + round_off),
                            committed_len=max(0, committed_len + len_off), draft_ids=draft, draft_probs=positions)


def calls(live: list[str], sessions: dict[str, list] | None = None) -> st.SearchStrategy:
    """(method, message or raw bytes) pairs over every RPC; with `sessions` (a Fuzzer's), also
    plausible opens and rounds that reach the verification rules."""
    plausible = [] if sessions is None else [
        st.tuples(st.just("OpenSession"), plausible_opens()),
        st.tuples(st.just("Verify"), plausible_verifies(sessions)),
        st.tuples(st.just("Verify"), plausible_verifies(sessions)),
        st.tuples(st.just("VerifyStream"), st.lists(plausible_verifies(sessions), min_size=1, max_size=2)),
    ]
    return st.one_of(*plausible,
        st.tuples(st.just("GetModelInfo"), st.just(pb.GetModelInfoRequest())),
        st.tuples(st.just("OpenSession"), open_requests(live)),
        st.tuples(st.just("OpenSessionStream"), open_requests(live)),
        st.tuples(st.just("Verify"), verify_requests(live)),
        st.tuples(st.just("VerifyStream"), st.lists(verify_requests(live), min_size=1, max_size=3)),
        st.tuples(st.just("CloseSession"), st.builds(pb.CloseSessionRequest, session_id=session_ids(live))),
        st.tuples(st.just("Generate"), generate_requests()),
        st.tuples(st.sampled_from(METHODS), st.binary(max_size=64)),  # undecodable or surprising bodies
    )


@dataclass
class Fuzzer:
    """Sends fuzz calls to one server, keeps live session ids, counts and checks every status."""

    channel: grpc.Channel
    timeout_s: float = 30.0
    live: list[str] = field(default_factory=list)
    sessions: dict[str, list] = field(default_factory=dict)  # live id -> [next round, committed length, needs q]
    counts: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stub = pb_grpc.VerifierStub(self.channel)
        self._raw = {m: (self.channel.stream_stream if m == "VerifyStream" else
                         self.channel.unary_stream if m in SERVER_STREAMS else self.channel.unary_unary)(
            f"/hybridspec.v1.Verifier/{m}", request_serializer=_as_bytes, response_deserializer=bytes)
            for m in METHODS}

    def send(self, method: str, message) -> grpc.StatusCode:
        """One call; returns its status and records whether it broke the rule."""
        code, details = grpc.StatusCode.OK, ""
        try:
            reply = self._call(method, message)
            if method == "OpenSessionStream" and isinstance(reply, list) and reply and reply[-1].HasField("opened"):
                reply = reply[-1].opened  # the messages before it are progress reports
            if method.startswith("OpenSession") and isinstance(reply, pb.OpenSessionReply):
                self._keep(reply.session_id, reply.committed_len, message.sampling.temperature > 0)
            for answer in (reply if isinstance(reply, list) else [reply]):
                if isinstance(answer, pb.VerifyReply):
                    self._advance(message, answer)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        self.counts[code.name] += 1
        if code not in ALLOWED or len(details) > MAX_DETAILS_CHARS or "Traceback" in details:
            self.violations.append(f"{method} -> {code.name}: {details[:500]!r} for {str(message)[:300]!r}")
        return code

    def _keep(self, session_id: str, committed_len: int, needs_probs: bool) -> None:
        """Aim later calls at this session; close the oldest beyond MAX_LIVE, leaving room for others
        from this address (the per-client session limit counts them all)."""
        if session_id not in self.live:
            self.live.append(session_id)
        self.sessions[session_id] = [0, committed_len, needs_probs]
        while len(self.live) > MAX_LIVE:
            old = self.live.pop(0)
            self.sessions.pop(old, None)
            try:
                self.stub.CloseSession(pb.CloseSessionRequest(session_id=old), timeout=self.timeout_s)
            except grpc.RpcError:
                pass  # counted where it matters: the fuzz calls themselves

    def _advance(self, message, reply: pb.VerifyReply) -> None:
        requests = message if isinstance(message, list) else [message]
        sid = next((r.session_id for r in requests if isinstance(r, pb.VerifyRequest)), None)
        if sid in self.sessions:
            self.sessions[sid][:2] = [reply.round + 1, reply.committed_len]

    def _call(self, method: str, message):
        timeout = self.timeout_s
        if isinstance(message, (bytes, list)) and method == "VerifyStream":
            requests = message if isinstance(message, list) else [message]
            call = self._raw[method] if isinstance(message, bytes) else self.stub.VerifyStream
            return list(call(iter(requests), timeout=timeout))
        if isinstance(message, bytes):
            reply = self._raw[method](message, timeout=timeout)
            return list(reply) if method in SERVER_STREAMS else reply
        if method in SERVER_STREAMS:
            return list(getattr(self.stub, method)(message, timeout=timeout))
        return getattr(self.stub, method)(message, timeout=timeout)


def _as_bytes(message) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()
