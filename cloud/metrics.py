"""Prometheus metrics of the front door (one registry per server, so tests can run several).

Names follow Prometheus conventions; acceptance per draft position is two counters whose ratio,
`accepted_at_position / drafted_at_position`, is the per-position acceptance rate (as vLLM exports).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ..common.wire import VerifyResult
from .backend import ReplicaStatus

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


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
        self.verify_seconds = Histogram("hybridspec_verify_seconds", "Front-door time per round (routing, queue, "
                                        "forward)", buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("hybridspec_queue_seconds", "Time a round waited on its replica before its "
                                       "forward pass (batching, other batches, prefill chunks): the overload signal",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.evictions = Counter("hybridspec_evictions", "Sessions evicted by replicas (idle or LRU)", registry=r)
        self.sessions_routed = Counter("hybridspec_sessions_routed", "Sessions routed to each replica", ["replica"],
                                       registry=r)
        self.replica_failures = Counter("hybridspec_replica_failures", "Replica crashes seen by the pool", registry=r)
        self.errors = Counter("hybridspec_errors", "Calls answered with an error status", ["code"], registry=r)
        self._seen: dict[tuple[str, str], int] = {}  # (counter, replica) -> the replica's last total

    def observe_round(self, gamma: int, result: VerifyResult, seconds: float) -> None:
        """Count one answered round with γ draft tokens."""
        self.rounds.inc()
        self.draft_tokens.inc(gamma)
        self.accepted_tokens.inc(result.num_accepted)
        for position in range(1, gamma + 1):
            self.drafted_at.labels(str(position)).inc()
            if position <= result.num_accepted:
                self.accepted_at.labels(str(position)).inc()
        self.batch_size.observe(result.batch_size)
        self.verify_seconds.observe(seconds)
        self.queue_seconds.observe(result.queue_ms / 1e3)

    def observe_replicas(self, replicas: list[ReplicaStatus]) -> None:
        """Refresh the per-replica gauges and add new evictions (a restarted replica counts from 0 again)."""
        self.replicas_alive.set(sum(r.alive for r in replicas))
        for r in replicas:
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

    def serve_http(self, host: str, port: int) -> int:
        """Expose /metrics on host:port (0 picks a free port); returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
