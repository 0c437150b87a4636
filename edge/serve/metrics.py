"""Prometheus metrics of `edge serve` (one registry per app, so tests can run several).

Requests are counted by endpoint and HTTP status, with their duration (for a stream: until its last
byte); generations by how they ended, with their tokens, the speculative work behind them (drafts,
drafted and accepted tokens under vLLM's spec_decode names, bytes each way), their time to first
token and their mean inter-token latency.
"""
from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..stats import Stats

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
OTHER = "other"  # the endpoint label of paths that are no route (bounded label cardinality)


class ServeMetrics:
    """Every metric the HTTP server exports."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("hybridspec_edge_http_requests_total", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.request_seconds = Histogram("hybridspec_edge_http_request_duration_seconds",
                                         "Time from request to the response's last byte", ["endpoint"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("hybridspec_edge_time_to_first_token_seconds",
                              "Time from a generation request to its first final text", ["endpoint"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("hybridspec_edge_inter_token_latency_seconds",
                             "Mean time between a generation's output tokens after its first (one observation "
                             "per generation)", ["endpoint"], buckets=ITL_BUCKETS, registry=r)
        self.in_flight = Gauge("hybridspec_edge_requests_in_flight",
                               "Generation requests admitted and not finished (running or waiting)", registry=r)
        self.running = Gauge("hybridspec_edge_generations_running", "Generations running on worker threads",
                             registry=r)
        self.generations = Counter("hybridspec_edge_generations_total",
                                   "Generations by how they ended (stop, length, error, cancelled)", ["outcome"],
                                   registry=r)
        self.prompt_tokens = Counter("hybridspec_edge_prompt_tokens_total", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("hybridspec_edge_completion_tokens_total", "Generated tokens", registry=r)
        self.drafted = Counter("hybridspec_edge_spec_decode_num_draft_tokens_total",
                               "Tokens drafted and sent for verification", registry=r)
        self.accepted = Counter("hybridspec_edge_spec_decode_num_accepted_tokens_total",
                                "Drafted tokens the verifier accepted", registry=r)
        self.rounds = Counter("hybridspec_edge_spec_decode_num_drafts_total", "Verify round trips (one block each)",
                              registry=r)
        self.cloud_only = Counter("hybridspec_edge_cloud_only_tokens_total", "Tokens the cloud decoded alone",
                                  registry=r)
        self.unverified = Counter("hybridspec_edge_unverified_tokens_total",
                                  "Tokens returned unverified (cloud unreachable, allow_unverified)", registry=r)
        self.uplink = Counter("hybridspec_edge_uplink_bytes_total", "Bytes sent to the cloud", registry=r)
        self.downlink = Counter("hybridspec_edge_downlink_bytes_total", "Bytes received from the cloud", registry=r)

    def observe_generation(self, endpoint: str, outcome: str, prompt_tokens: int, stats: Stats | None,
                           ttft_s: float | None, itl_s: float | None = None) -> None:
        """One generation ended (`stats` None: it never started)."""
        self.generations.labels(outcome).inc()
        if ttft_s is not None:
            self.ttft.labels(endpoint).observe(ttft_s)
        if itl_s is not None:
            self.itl.labels(endpoint).observe(itl_s)
        if stats is None:
            return
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(stats.new_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.rounds.inc(stats.rounds)
        self.cloud_only.inc(stats.cloud_only_tokens)
        self.unverified.inc(stats.unverified)
        self.uplink.inc(stats.uplink_bytes)
        self.downlink.inc(stats.downlink_bytes)

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)


class RequestMetrics:
    """ASGI middleware: counts every request by endpoint (a route path, or `other`) and status, and
    times it to its last byte. An exception that escapes the app counts as a 500."""

    def __init__(self, app: ASGIApp, metrics: ServeMetrics, endpoints: set[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in self.endpoints else OTHER
        status = 500
        start = time.perf_counter()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - start)
