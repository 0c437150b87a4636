"""The edges of an experiment: one per concurrent slot and strategy, over the emulated link.

A slot runs its edges in the experiment's own process (`Slot`; threads: cheap, but they share one
interpreter) or, with `edge_processes: true`, in a process of its own (`ProcessSlot`), as N devices
would (each with its own interpreter, drafter and connection; spawned, so no forked gRPC or llama.cpp
state).
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from ..common.models.loading import LoadedModel
from ..common.protocol.wire import DecodeSpec, Mode, SessionSpec
from ..edge.client import VerifierClient
from ..edge.config import EdgeConfig
from ..edge.controller import DEFAULT_RATES
from ..edge.generation import EventKind
from ..edge.worker import EdgeWorker
from .clock import CommitClock
from .spec import ExperimentSpec, GridPoint, Strategy

STATS_KEYS = ["acceptance_rate", "mean_tokens_per_round", "rounds", "drafted", "accepted", "mean_gamma",
              "cloud_calls_per_token", "bytes_per_token", "uplink_bytes", "downlink_bytes", "cloud_only_tokens",
              "switches_to_cloud", "switches_to_hybrid", "shadow_guesses", "pipeline_hits", "fallbacks", "drafted_at", "accepted_at"]


class EdgeHost(Protocol):
    """What an edge takes from the experiment it runs in (lab/runner.py's Lab)."""

    spec: ExperimentSpec
    pin: bool  # edges on edge_cores, one torch thread (a process slot applies it to itself)
    edge_cores: set[int]

    def edge_config(self, strategy: Strategy, point: GridPoint, address: str, repeat: int) -> EdgeConfig: ...

    def drafter_for(self, cfg: EdgeConfig) -> tuple[LoadedModel, LoadedModel | None]: ...


class Slot:
    """One concurrent edge slot in this process: an Edge per strategy, kept across prompts."""

    def __init__(self, lab: EdgeHost, strategies: list[Strategy], point: GridPoint, address: str) -> None:
        self.edges = {s.name: Edge(lab, s, point, address) for s in strategies}

    def generate(self, strategy: str, prompt: list[int], repeat: int, trace: Path | None) -> dict:
        """One generation of `strategy`'s edge: the raw row fields."""
        return self.edges[strategy].generate(prompt, repeat, trace)

    def close(self) -> None:
        """Close every edge's connection."""
        for edge in self.edges.values():
            edge.close()


class Edge:
    """One edge over the link for one strategy: a connection, and for hybrid strategies a worker that
    keeps its estimates across generations."""

    def __init__(self, lab: EdgeHost, strategy: Strategy, point: GridPoint, address: str) -> None:
        self.lab, self.strategy = lab, strategy
        self.config = lab.edge_config(strategy, point, address, 0)
        self.client = VerifierClient(address, timeout_s=self.config.link.timeout_s)
        self.worker: EdgeWorker | None = None

    def generate(self, prompt: list[int], repeat: int, trace: Path | None = None) -> dict:
        """One generation; the raw row fields, with what the edge measured: its RTT to the cloud,
        time to first token, and the time between successive commits (a round, or a streamed token)."""
        cfg = self.config.updated(seed=self.lab.spec.seed + repeat)
        clock = CommitClock()
        if self.strategy.kind == "cloud_only":
            # What `--cloud-only` does: a session opened at the front door, decoded on its replica's port.
            spec = SessionSpec("", tuple(prompt), sampling=cfg.sampling, seed=cfg.generation.seed,
                               mode=Mode.GREEDY if cfg.sampling.greedy else Mode.COUPLED)
            rtt_start = time.perf_counter()
            self.client.model_info()  # connected before the clock starts, as an edge worker is; one round trip
            rtt_ms = (time.perf_counter() - rtt_start) * 1e3
            up0, down0 = self.client.uplink_bytes, self.client.downlink_bytes
            clock.start()
            tokens = []
            session = self.client.open_session(spec).session_id
            for token in self.client.decode(DecodeSpec(session, 0, len(prompt), cfg.generation.max_new_tokens)):
                tokens.append(token)
                clock.commit([token], "cloud")
            wall = clock.elapsed()
            self.client.close_session_later(session)
            up, down = self.client.uplink_bytes - up0, self.client.downlink_bytes - down0
            clock.write(trace)
            return {"tokens": tokens, "wall_s": wall, "cloud_calls_per_token": 2 / max(len(tokens), 1),
                    "uplink_bytes": up, "downlink_bytes": down, "bytes_per_token": (up + down) / max(len(tokens), 1),
                    "measured_rtt_ms": rtt_ms, "edge_pid": os.getpid(), **clock.summary()}
        if self.worker is None:
            drafter, fallback = self.lab.drafter_for(cfg)
            self.worker = EdgeWorker(drafter, self.client, cfg, fallback)
        self.worker.config = cfg
        gen = self.worker.stream(prompt)
        clock.start()
        for event in gen:
            if event.kind == EventKind.COMMIT and event.tokens:
                clock.commit(event.tokens, [o.value for o in event.origins])
        clock.write(trace)
        stats = gen.stats.to_dict()
        rates = self.worker.estimates.rates(DEFAULT_RATES)
        return {"tokens": gen.token_ids, "wall_s": gen.stats.wall_s, **{k: stats[k] for k in STATS_KEYS},
                "rates": {k: v for k, v in dataclasses.asdict(rates).items() if k != "alphas"},
                "measured_rtt_ms": rates.rtt_s * 1e3, "edge_pid": os.getpid(), **clock.summary()}

    def close(self) -> None:
        """Close the connection."""
        self.client.close()


class ProcessSlot:
    """A slot whose edges live in a process of their own; `generate` and `close` as Slot's. `host`: the
    experiment's class (lab/runner.py's Lab), which the process builds for its configs and drafters."""

    def __init__(self, host: Callable[[ExperimentSpec, Path], EdgeHost], spec: ExperimentSpec, out: Path,
                 strategies: list[Strategy], point: GridPoint, address: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve_slot, args=(child, host, spec, out, strategies, point, address),
                                        daemon=True, name="edge-slot")
        self._process.start()

    def wait_ready(self) -> None:
        """Wait until the process has loaded its drafter and connected; its error, if it could not."""
        reply = self._conn.recv()
        if reply != "ready":
            raise RuntimeError(f"an edge process did not start: {reply}")

    def generate(self, strategy: str, prompt: list[int], repeat: int, trace: Path | None) -> dict:
        """One generation in the process: the raw row fields."""
        self._conn.send((strategy, prompt, repeat, trace))
        return self._conn.recv()

    def close(self) -> None:
        """Let the process close its connections and exit."""
        try:
            self._conn.send(None)
        except OSError:
            pass  # it is gone already
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()


def _serve_slot(conn, host: Callable[[ExperimentSpec, Path], EdgeHost], spec: ExperimentSpec, out: Path,
                strategies: list[Strategy], point: GridPoint, address: str) -> None:
    """A slot process: its own experiment host for configs and drafters, on the edge cores, one torch thread."""
    try:
        lab = host(spec, out)
        if lab.pin:
            os.sched_setaffinity(0, lab.edge_cores)
            torch.set_num_threads(1)
        slot = Slot(lab, strategies, point, address)
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    conn.send("ready")
    try:
        while (job := conn.recv()) is not None:
            try:
                conn.send(slot.generate(*job))
            except Exception as exc:  # a row with its error, as for an edge in this process
                conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        slot.close()
