"""Prometheus metrics of the front door (one registry per server, so tests can run several).

Names follow Prometheus conventions; acceptance per draft position is two counters whose ratio,
`accepted_at_position / drafted_at_position`, is the per-position acceptance rate (as vLLM exports).
Rounds a replica answers on its own endpoint (direct verify) never pass the front door: the replica
keeps them in an `EndpointTally` and the front door adds them to its metrics at each status refresh.
"""
from __future__ import annotations

import collections
import socket
import threading
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, make_wsgi_app

from ..common.wire import SessionOpened, VerifyResult

if TYPE_CHECKING:  # backend.py imports this module for Tally
    from .backend import ReplicaStatus

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TALLY_KEEP = 100_000  # rounds a replica keeps for the front door; older ones are dropped if it never asks

# Counters and histograms export no `<name>_created` series: it doubles every series for a timestamp no
# dashboard uses. Process-wide in prometheus_client, so it is set once, when this module loads.
disable_created_metrics()


@dataclass(frozen=True)
class RoundSample:
    """One answered round, as the round metrics count it."""

    gamma: int  # draft tokens
    num_accepted: int
    batch_size: int
    seconds: float  # time the serving endpoint spent on it
    queue_ms: float
    feature_bytes: int = 0  # features sent with the reply (sessions of an EAGLE drafter)


@dataclass(frozen=True)
class Tally:
    """What a replica's own endpoint answered since the front door last asked."""

    rounds: tuple[RoundSample, ...] = ()
    errors: tuple[tuple[str, int], ...] = ()  # (status code, calls)


def _sample(gamma: int, result: VerifyResult, seconds: float) -> RoundSample:
    return RoundSample(gamma, result.num_accepted, result.batch_size, seconds, result.queue_ms,
                       result.features.nbytes if result.features is not None else 0)


class EndpointTally:
    """The metrics sink of a replica's own Verify endpoint: it only remembers, until `take`."""

    def __init__(self) -> None:
        self._rounds: collections.deque[RoundSample] = collections.deque(maxlen=TALLY_KEEP)
        self._errors: collections.Counter[str] = collections.Counter()

    def observe_round(self, gamma: int, result: VerifyResult, seconds: float) -> None:
        """Remember one answered round."""
        self._rounds.append(_sample(gamma, result, seconds))

    def observe_error(self, code: str) -> None:
        """Remember one call answered with an error status."""
        self._errors[code] += 1

    def take(self) -> Tally:
        """Everything remembered since the last call."""
        tally = Tally(tuple(self._rounds), tuple(self._errors.items()))
        self._rounds.clear()
        self._errors.clear()
        return tally


class Metrics:
    """Every metric the front door exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sessions_open = Gauge("hybridspec_sessions_open", "Sessions held per replica", ["replica"], registry=r)
        self.cached_tokens = Gauge("hybridspec_cached_tokens", "Committed tokens held per replica", ["replica"],
                                   registry=r)
        self.replicas_alive = Gauge("hybridspec_replicas_alive", "Replicas answering", registry=r)
        self.sessions_opened = Counter("hybridspec_sessions_opened", "OpenSession calls for new sessions", registry=r)
        self.reopens = Counter("hybridspec_session_reopens", "OpenSession calls re-opening a lost session", registry=r)
        self.rounds = Counter("hybridspec_rounds", "Verification rounds answered", registry=r)
        self.draft_tokens = Counter("hybridspec_draft_tokens", "Draft tokens received", registry=r)
        self.accepted_tokens = Counter("hybridspec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.drafted_at = Counter("hybridspec_drafted_at_position", "Rounds whose draft reached position",
                                  ["position"], registry=r)
        self.accepted_at = Counter("hybridspec_accepted_at_position", "Rounds whose draft token at position was "
                                   "accepted", ["position"], registry=r)
        self.generated_tokens = Counter("hybridspec_generate_tokens", "Tokens streamed by cloud-only Generate",
                                        registry=r)
        self.batch_size = Histogram("hybridspec_batch_size", "Rounds scored per forward pass", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.verify_seconds = Histogram("hybridspec_verify_seconds", "Time per round at the endpoint that served it "
                                        "(the front door: routing, queue, forward; a replica: queue, forward)", buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("hybridspec_queue_seconds", "Time a round waited on its replica before its "
                                       "forward pass (batching, other batches, prefill chunks): the overload signal",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.evictions = Counter("hybridspec_evictions", "Sessions evicted by replicas (idle or LRU)", registry=r)
        self.sessions_routed = Counter("hybridspec_sessions_routed", "Sessions routed to each replica", ["replica"],
                                       registry=r)
        self.replica_failures = Counter("hybridspec_replica_failures", "Replica crashes seen by the pool", registry=r)
        self.errors = Counter("hybridspec_errors", "Calls answered with an error status", ["code"], registry=r)
        self.feature_bytes = Counter("hybridspec_feature_bytes", "Bytes of target features sent to edges that "
                                     "asked for them (OpenSession and Verify replies)", registry=r)
        self._seen: dict[tuple[str, str], int] = {}  # (counter, replica) -> the replica's last total

    def observe_round(self, gamma: int, result: VerifyResult, seconds: float) -> None:
        """Count one answered round with γ draft tokens."""
        self._count(_sample(gamma, result, seconds))

    def observe_opened(self, opened: SessionOpened) -> None:
        """Count what an OpenSession reply carries besides the session (its features)."""
        if opened.features is not None:
            self.feature_bytes.inc(opened.features.nbytes)

    def observe_error(self, code: str) -> None:
        """Count one call answered with an error status."""
        self.errors.labels(code).inc()

    def add_tally(self, tally: Tally) -> None:
        """Count what a replica's own endpoint answered."""
        for sample in tally.rounds:
            self._count(sample)
        for code, calls in tally.errors:
            self.errors.labels(code).inc(calls)

    def _count(self, s: RoundSample) -> None:
        self.rounds.inc()
        self.draft_tokens.inc(s.gamma)
        self.accepted_tokens.inc(s.num_accepted)
        for position in range(1, s.gamma + 1):
            self.drafted_at.labels(str(position)).inc()
            if position <= s.num_accepted:
                self.accepted_at.labels(str(position)).inc()
        self.batch_size.observe(s.batch_size)
        self.verify_seconds.observe(s.seconds)
        self.queue_seconds.observe(s.queue_ms / 1e3)
        self.feature_bytes.inc(s.feature_bytes)

    def observe_replicas(self, replicas: list[ReplicaStatus]) -> None:
        """Refresh the per-replica gauges and add new evictions (a restarted replica counts from 0 again)."""
        self.replicas_alive.set(sum(r.alive for r in replicas))
        for r in replicas:
            self.add_tally(r.direct)
            self._add_new("failures", r.name, r.failures, self.replica_failures)
            self._add_new("routed", r.name, r.routed_total, self.sessions_routed.labels(r.name))
            self.sessions_open.labels(r.name).set(r.sessions)
            self.cached_tokens.labels(r.name).set(r.cached_tokens)
            if r.alive:  # a dead replica reports zeros, not a reset
                self._add_new("evictions", r.name, r.evictions, self.evictions)

    def _add_new(self, what: str, replica: str, total: int, counter) -> None:
        """Add what a replica's running total gained since last time; a smaller total means the
        replica restarted and counts from 0 again."""
        seen = self._seen.get((what, replica), 0)
        counter.inc(total - seen if total >= seen else total)
        self._seen[(what, replica)] = total

    def serve_http(self, host: str, port: int) -> MetricsHTTPServer:
        """Serve /metrics and /health on host:port (0 picks a free port) from a daemon thread.
        OSError (EADDRINUSE...) if the port cannot be bound."""
        return MetricsHTTPServer(self.registry, host, port)


class MetricsHTTPServer:
    """/metrics (the registry, in Prometheus text format), /health (200 while the process answers:
    liveness; readiness is the gRPC health service), 404 for every other path."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        metrics_app = make_wsgi_app(registry)

        def app(environ, start_response):
            path = environ.get("PATH_INFO", "")
            if path == "/metrics":
                return metrics_app(environ, start_response)
            if path == "/health":
                return _plain(start_response, "200 OK", b"ok\n")
            return _plain(start_response, "404 Not Found", b"not found: try /metrics or /health\n")

        server_class = type("MetricsWSGIServer", (_ThreadingWSGIServer,), {"address_family": _family(host, port)})
        self._server = make_server(host, port, app, server_class, _QuietHandler)
        self.port: int = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="metrics-http")
        self._thread.start()

    def close(self) -> None:
        """Stop answering and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _family(host: str, port: int) -> socket.AddressFamily:
    """IPv4 or IPv6, whichever `host` is (as prometheus_client's own server chooses)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return infos[0][0]


def _plain(start_response, status: str, body: bytes) -> list[bytes]:
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
    return [body]


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds up shutdown


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # no access log on stderr
        pass
