"""Prometheus metrics of the front door (one registry per server, so tests can run several).

Speculative-decoding counters carry vLLM's names and meanings under the `hybridspec_` prefix, so
dashboards built for vLLM read them: `spec_decode_num_drafts` (rounds with at least one draft token),
`spec_decode_num_draft_tokens`, `spec_decode_num_accepted_tokens`, and
`spec_decode_num_accepted_tokens_per_pos{position}` counted from 0. Blocks here vary in length, so
`spec_decode_num_draft_tokens_per_pos` (ours) says how many drafts reached each position: their ratio
is the acceptance rate at a position. `time_to_first_token_seconds`, `inter_token_latency_seconds`,
`request_queue_time_seconds` (a request being one round), `iteration_tokens_total` (tokens per
forward pass), `kv_cache_usage_perc`, `prompt_tokens_total` and `generation_tokens_total` mean what
vLLM's do (docs/architecture.md lists every metric).

Rounds a replica answers on its own endpoint (direct verify) never pass the front door: the replica
keeps them in an `EndpointTally` and the front door adds them to its metrics at each status refresh.
What a replica measures about its own steps (time to first token, inter-token latency, iteration
tokens, KV fill) arrives in its status as snapshots and is exported per replica as it was last seen.
"""
from __future__ import annotations

import collections
import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ...common.protocol.wire import SessionOpened, VerifyResult
from ..core.telemetry import Buckets, HistogramSnapshot, ReplicaTelemetry, RoundSample, Tally
from ..pool.pool import ReplicaStatus

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TALLY_KEEP = 100_000  # rounds a replica keeps for the front door; older ones are dropped if it never asks

# Counters and histograms export no `<name>_created` series: it doubles every series for a timestamp no
# dashboard uses. Process-wide in prometheus_client, so it is set once, when this module loads.
disable_created_metrics()


def _sample(gamma: int, result: VerifyResult, seconds: float) -> RoundSample:
    return RoundSample(gamma, result.num_accepted, result.batch_size, seconds, result.queue_ms,
                       result.features.nbytes if result.features is not None else 0)


class EndpointTally:
    """The metrics sink of a replica's own Verify endpoint: it only remembers, until `take`."""

    def __init__(self) -> None:
        self._rounds: collections.deque[RoundSample] = collections.deque(maxlen=TALLY_KEEP)
        self._errors: collections.Counter[str] = collections.Counter()
        self._tokens = 0

    def observe_round(self, gamma: int, result: VerifyResult, seconds: float) -> None:
        """Remember one answered round."""
        self._rounds.append(_sample(gamma, result, seconds))

    def observe_error(self, code: str) -> None:
        """Remember one call answered with an error status."""
        self._errors[code] += 1

    def observe_generated(self) -> None:
        """Remember one token a Decode stream sent."""
        self._tokens += 1

    def take(self) -> Tally:
        """Everything remembered since the last call."""
        tally = Tally(tuple(self._rounds), tuple(self._errors.items()), self._tokens)
        self._rounds.clear()
        self._errors.clear()
        self._tokens = 0
        return tally


class Metrics:
    """Every metric the front door exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.serving = threading.Event()  # set while the gRPC health service reports SERVING
        self.sessions_open = Gauge("hybridspec_sessions_open", "Sessions held per replica", ["replica"], registry=r)
        self.cached_tokens = Gauge("hybridspec_cached_tokens", "Committed tokens held per replica", ["replica"],
                                   registry=r)
        self.kv_usage = Gauge("hybridspec_kv_cache_usage_perc", "Fraction of the replica's KV pool in use (0..1)",
                              ["replica"], registry=r)
        self.replicas_alive = Gauge("hybridspec_replicas_alive", "Replicas answering", registry=r)
        self.sessions_opened = Counter("hybridspec_sessions_opened", "OpenSession calls for new sessions", registry=r)
        self.reopens = Counter("hybridspec_session_reopens", "OpenSession calls re-opening a lost session", registry=r)
        self.rounds = RoundCounters()
        r.register(self.rounds)
        self.prompt_tokens = Counter("hybridspec_prompt_tokens", "Prompt tokens prefilled (OpenSession, re-opens "
                                     "included, and Generate)", registry=r)
        self.evictions = Counter("hybridspec_evictions", "Sessions evicted by replicas (idle or LRU)", registry=r)
        self.sessions_routed = Counter("hybridspec_sessions_routed", "Sessions routed to each replica", ["replica"],
                                       registry=r)
        self.replica_failures = Counter("hybridspec_replica_failures", "Replica crashes seen by the pool", registry=r)
        self.errors = Counter("hybridspec_errors", "Calls answered with an error status", ["code"], registry=r)
        self.prefix_lookups = Counter("hybridspec_prefix_cache_queries", "New sessions that looked for a cached "
                                      "prefix of their prompt (vLLM's prefix_cache_queries counts tokens)", registry=r)
        self.prefix_hits = Counter("hybridspec_prefix_cache_hits", "New sessions that started from a cached prefix",
                                   registry=r)
        self.prefix_tokens = Counter("hybridspec_prefix_cache_tokens_saved", "Prompt tokens not prefilled: copied "
                                     "from a cached prefix", registry=r)
        self.prefix_kept = Gauge("hybridspec_prefix_cache_kept_tokens", "Tokens of closed sessions' caches kept "
                                 "for reuse, per replica", ["replica"], registry=r)
        self.parked_tokens = Gauge("hybridspec_kv_parked_tokens", "Tokens of idle sessions parked in host memory "
                                   "(llama.cpp), per replica", ["replica"], registry=r)
        self.pass_fixed = Gauge("hybridspec_pass_fixed_seconds", "What a forward pass costs however few rows it "
                                "has (the replica's pass-time model), per replica", ["replica"], registry=r)
        self.edge_return = Gauge("hybridspec_edge_return_seconds", "How soon nine in ten answered edges send their "
                                 "next round (+Inf until measured), per replica; the auto hold keeps one group "
                                 "while this is below hybridspec_pass_fixed_seconds", ["replica"], registry=r)
        self.replica_histograms = ReplicaHistograms()
        r.register(self.replica_histograms)
        self._seen: dict[tuple[str, str], int] = {}  # (counter, replica) -> the replica's last total

    def observe_round(self, gamma: int, result: VerifyResult, seconds: float) -> None:
        """Count one answered round with γ draft tokens."""
        self.rounds.count(_sample(gamma, result, seconds))

    def observe_opened(self, prompt_tokens: int, opened: SessionOpened | None = None) -> None:
        """Count a prefill of `prompt_tokens` (an open, or a Generate's prompt) and what an OpenSession
        reply carries besides the session (its features)."""
        self.prompt_tokens.inc(prompt_tokens)
        if opened is not None and opened.features is not None:
            self.rounds.feature_bytes += opened.features.nbytes

    def observe_generated(self, tokens: int = 1) -> None:
        """Count tokens a cloud-only stream (Generate or Decode) sent."""
        self.rounds.generated_tokens += tokens
        self.rounds.generation_tokens += tokens

    def observe_error(self, code: str) -> None:
        """Count one call answered with an error status."""
        self.errors.labels(code).inc()

    def add_tally(self, tally: Tally) -> None:
        """Count what a replica's own endpoint answered."""
        for sample in tally.rounds:
            self.rounds.count(sample)
        for code, calls in tally.errors:
            self.errors.labels(code).inc(calls)
        self.observe_generated(tally.tokens)

    def observe_replicas(self, replicas: list[ReplicaStatus]) -> None:
        """Refresh the per-replica gauges and histograms and add new evictions (a restarted replica
        counts from 0 again)."""
        self.replicas_alive.set(sum(r.alive for r in replicas))
        for r in replicas:
            self.add_tally(r.direct)
            self._add_new("failures", r.name, r.failures, self.replica_failures)
            self._add_new("routed", r.name, r.routed_total, self.sessions_routed.labels(r.name))
            self.sessions_open.labels(r.name).set(r.sessions)
            self.cached_tokens.labels(r.name).set(r.cached_tokens)
            self.prefix_kept.labels(r.name).set(r.prefixes.kept_tokens)
            self.parked_tokens.labels(r.name).set(r.parked_tokens)
            if r.alive:  # a dead replica reports zeros, not a reset
                self._add_new("evictions", r.name, r.evictions, self.evictions)
                self._add_new("prefix_lookups", r.name, r.prefixes.lookups, self.prefix_lookups)
                self._add_new("prefix_hits", r.name, r.prefixes.hits, self.prefix_hits)
                self._add_new("prefix_tokens", r.name, r.prefixes.tokens_saved, self.prefix_tokens)
                if r.telemetry is not None:
                    self.kv_usage.labels(r.name).set(r.telemetry.kv_usage)
                    self.pass_fixed.labels(r.name).set(r.telemetry.pass_fixed_s)
                    self.edge_return.labels(r.name).set(r.telemetry.return_s)
                    self.replica_histograms.update(r.name, r.telemetry)

    def _add_new(self, what: str, replica: str, total: int, counter) -> None:
        """Add what a replica's running total gained since last time; a smaller total means the
        replica restarted and counts from 0 again."""
        seen = self._seen.get((what, replica), 0)
        counter.inc(total - seen if total >= seen else total)
        self._seen[(what, replica)] = total

    def serve_http(self, host: str, port: int) -> MetricsHTTPServer:
        """Serve /metrics, /health and /health/ready on host:port (0 picks a free port) from a daemon
        thread. OSError (EADDRINUSE...) if the port cannot be bound."""
        return MetricsHTTPServer(self.registry, host, port, self.serving.is_set)


class RoundCounters(Collector):
    """The front door's round and token counters, kept as plain numbers on its event loop and exported at
    each scrape. A prometheus_client Counter or Histogram takes a lock at every increment: a round of γ
    draft tokens made 2γ + 7 of them, on the loop that also reads and writes every gRPC message. Read by
    the scrape's thread without a lock: a scrape may see a round half counted, never a count lost."""

    def __init__(self) -> None:
        self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.drafted_at: list[int] = []  # per position of a block, from 0: drafts that reached it
        self.accepted_at: list[int] = []  # ... and were accepted there
        self.generation_tokens = self.generated_tokens = self.feature_bytes = 0
        self.batch_size = Buckets(BATCH_BUCKETS)
        self.verify_seconds = Buckets(LATENCY_BUCKETS)
        self.queue_seconds = Buckets(LATENCY_BUCKETS)

    def count(self, s: RoundSample) -> None:
        """One answered round."""
        if s.gamma:
            self.drafts += 1
            self.draft_tokens += s.gamma
            while len(self.drafted_at) < s.gamma:
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            for position in range(s.gamma):
                self.drafted_at[position] += 1
            for position in range(min(s.num_accepted, s.gamma)):
                self.accepted_at[position] += 1
        self.accepted_tokens += s.num_accepted
        self.generation_tokens += s.num_accepted + 1
        self.batch_size.observe(s.batch_size)
        self.verify_seconds.observe(s.seconds)
        self.queue_seconds.observe(s.queue_ms / 1e3)
        self.feature_bytes += s.feature_bytes

    def collect(self):
        """Every counter and histogram as it stands (names as documented at the top of this module)."""
        for name, documentation, value in (
                ("hybridspec_spec_decode_num_drafts", "Rounds that carried at least one draft token", self.drafts),
                ("hybridspec_spec_decode_num_draft_tokens", "Draft tokens received", self.draft_tokens),
                ("hybridspec_spec_decode_num_accepted_tokens", "Draft tokens accepted", self.accepted_tokens),
                ("hybridspec_generation_tokens", "Tokens committed: accepted drafts plus each round's correction or "
                 "bonus token, and Generate's tokens", self.generation_tokens),
                ("hybridspec_generate_tokens", "Tokens streamed by cloud-only decoding (Generate, and Decode at the "
                 "front door or a replica's endpoint)", self.generated_tokens),
                ("hybridspec_feature_bytes", "Bytes of target features sent to edges that asked for them "
                 "(OpenSession and Verify replies)", self.feature_bytes)):
            yield CounterMetricFamily(name, documentation, value=value)
        for name, documentation, counts in (
                ("hybridspec_spec_decode_num_accepted_tokens_per_pos",
                 "Draft tokens accepted at each position of a block, counted from 0", self.accepted_at),
                ("hybridspec_spec_decode_num_draft_tokens_per_pos",
                 "Draft tokens received at each position of a block, counted from 0 (the acceptance rate at a "
                 "position is accepted_per_pos / this)", self.drafted_at)):
            family = CounterMetricFamily(name, documentation, labels=["position"])
            for position, count in enumerate(list(counts)):
                family.add_metric([str(position)], count)
            yield family
        for name, documentation, buckets in (
                ("hybridspec_batch_size", "Rounds scored in the forward pass that scored each round (one "
                 "observation per round)", self.batch_size),
                ("hybridspec_verify_seconds", "Time per round at the endpoint that served it (the front door: "
                 "routing, queue, forward; a replica: queue, forward)", self.verify_seconds),
                ("hybridspec_request_queue_time_seconds", "Time a round waited on its replica before its forward "
                 "pass (batching, other batches, prefill chunks): the overload signal", self.queue_seconds)):
            snapshot = buckets.snapshot()
            yield HistogramMetricFamily(name, documentation, buckets=_cumulative(snapshot), sum_value=snapshot.total)


class ReplicaHistograms(Collector):
    """The replicas' own histograms, exported with a `replica` label as each replica last reported them
    (a restarted replica starts from 0 again, which Prometheus reads as a counter reset)."""

    METRICS = (("ttft", "hybridspec_time_to_first_token_seconds",
                "Time from a replica taking a new generation's open to its first answered round"),
               ("itl", "hybridspec_inter_token_latency_seconds",
                "Time between a session's answers per token committed (one observation per token)"),
               ("iteration_tokens", "hybridspec_iteration_tokens_total",
                "Tokens carried by each forward pass (rounds' blocks and prefill chunks)"))

    def __init__(self) -> None:
        self._latest: dict[str, ReplicaTelemetry] = {}
        self._lock = threading.Lock()

    def update(self, replica: str, telemetry: ReplicaTelemetry) -> None:
        """Keep a replica's newest snapshot."""
        with self._lock:
            self._latest[replica] = telemetry

    def collect(self):
        """One histogram family per metric, a labelled series per replica."""
        with self._lock:
            latest = dict(self._latest)
        for attribute, name, documentation in self.METRICS:
            family = HistogramMetricFamily(name, documentation, labels=["replica"])
            for replica, telemetry in sorted(latest.items()):
                snapshot: HistogramSnapshot = getattr(telemetry, attribute)
                family.add_metric([replica], _cumulative(snapshot), snapshot.total)
            yield family


def _cumulative(snapshot: HistogramSnapshot) -> list[tuple[str, int]]:
    """Prometheus buckets: (upper bound, observations at or below it), ending with +Inf."""
    running, buckets = 0, []
    for bound, count in zip((*snapshot.bounds, float("inf")), snapshot.counts):
        running += count
        buckets.append((floatToGoString(bound), running))  # as prometheus_client's own histograms write them
    return buckets


class MetricsHTTPServer:
    """/metrics (the registry, in Prometheus text format), /health (200 while the process answers:
    liveness), /health/ready (200 while the front door is SERVING, else 503: readiness, for probes that
    cannot speak gRPC over TLS), 404 for every other path."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, ready=lambda: True) -> None:
        metrics_app = make_wsgi_app(registry)

        def app(environ, start_response):
            path = environ.get("PATH_INFO", "")
            if path == "/metrics":
                return metrics_app(environ, start_response)
            if path == "/health":
                return _plain(start_response, "200 OK", b"ok\n")
            if path == "/health/ready":
                return (_plain(start_response, "200 OK", b"serving\n") if ready()
                        else _plain(start_response, "503 Service Unavailable", b"not serving\n"))
            return _plain(start_response, "404 Not Found", b"not found: try /metrics, /health or /health/ready\n")

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
