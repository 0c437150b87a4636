"""Part (d): N edges against one GPU verifier through real gRPC (the in-process backend; the GPU
machine has no Ray), cloud-only against hybrid with an oracle drafter of set agreement.

Cloud-only edges stream the target's tokens with the Generate RPC. Hybrid edges open a session and
send rounds of γ drafts; the oracle drafter knows the token cloud-only decoding emitted at each
position (the reference, from the cloud-only run of the same prompt) and proposes it with
probability α, and it spends `draft_ms` per drafted token, as a drafter on the edge device would.
Edges run as threads in a few worker processes, so client-side Python does not share the server's
interpreter. Links are emulated with the user-space relay (netem/relay.py): RTT = 2 × delay.
"""
from __future__ import annotations

import multiprocessing
import random
import statistics
import threading
import time
from dataclasses import dataclass

from ...common.protocol.wire import DraftBlock, GenerateSpec, SessionSpec


@dataclass(frozen=True)
class EdgeJob:
    """What one edge does in one run."""

    address: str
    prompt: tuple[int, ...]
    new_tokens: int
    vocab: int
    reference: tuple[int, ...] = ()  # empty: decode cloud-only
    agree: float = 0.0
    gamma: int = 4
    draft_ms: float = 0.0
    seed: int = 0


def run_edge(job: EdgeJob, start: threading.Barrier | None = None) -> dict:
    """One edge's generation: its tokens, its wall time and the gaps between its commits (ms)."""
    from ...edge.client import VerifierClient

    with VerifierClient(job.address, timeout_s=120.0) as client:
        if start is not None:
            start.wait()
        began = time.perf_counter()
        stamps, tokens = [], []
        if not job.reference:
            for token in client.generate(GenerateSpec(job.prompt, max_new_tokens=job.new_tokens)):
                tokens.append(token)
                stamps.append(time.perf_counter())
        else:
            rng = random.Random(job.seed)
            opened = client.open_session(SessionSpec("", job.prompt))
            committed, r = list(job.prompt), 0
            while len(tokens) < job.new_tokens:
                at = len(tokens)
                time.sleep(job.draft_ms * job.gamma / 1e3)
                draft = []
                for d in range(job.gamma):
                    right = job.reference[at + d] if at + d < len(job.reference) else 0
                    draft.append(right if rng.random() < job.agree else (right + 1) % job.vocab)
                result = client.verify(DraftBlock(opened.session_id, r, len(committed), tuple(draft)))
                new = draft[:result.num_accepted] + [result.next_token]
                committed += new
                tokens += new
                stamps.append(time.perf_counter())
                r += 1
            client.close_session(opened.session_id)
    gaps = [(b - a) * 1e3 for a, b in zip([began, *stamps], stamps)]
    return {"tokens": tokens[:job.new_tokens], "seconds": stamps[-1] - began, "gaps_ms": gaps,
            "rounds": len(stamps)}


def _worker(jobs: list[EdgeJob]) -> list[dict]:
    """A worker process's share of the edges, as concurrent threads started together."""
    results: list[dict | None] = [None] * len(jobs)
    barrier = threading.Barrier(len(jobs))

    def one(i: int) -> None:
        try:
            results[i] = run_edge(jobs[i], barrier)
        except Exception as exc:  # reported per edge; the run goes on
            results[i] = {"error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results  # type: ignore[return-value]


class EdgeFleet:
    """Worker processes that run edges; made once, reused for every run."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._pool = multiprocessing.get_context("spawn").Pool(processes)

    def warm_up(self, address: str, vocab: int) -> None:
        """One short generation per process: imports and first connections stay out of the numbers."""
        self.run([EdgeJob(address, (1, 2, 3), 2, vocab) for _ in range(self.processes)])

    def run(self, jobs: list[EdgeJob]) -> tuple[list[dict], float]:
        """Every job at once; (per-edge results in job order, wall seconds of the whole run)."""
        shares = [jobs[i::self.processes] for i in range(self.processes)]
        began = time.perf_counter()
        parts = self._pool.map(_worker, [s for s in shares if s])
        wall = time.perf_counter() - began
        results: list[dict] = [{}] * len(jobs)
        for p, part in enumerate(parts):
            for k, result in enumerate(part):
                results[p + k * self.processes] = result
        return results, wall

    def close(self) -> None:
        self._pool.close()
        self._pool.join()


def summarise(results: list[dict], wall: float) -> dict:
    """Committed tokens/s of the whole group, per edge, and the p95 gap between commits."""
    ok = [r for r in results if "error" not in r]
    gaps = sorted(g for r in ok for g in r["gaps_ms"])
    p95 = gaps[min(len(gaps) - 1, int(0.95 * len(gaps)))] if gaps else None
    per_edge = [len(r["tokens"]) / r["seconds"] for r in ok if r["seconds"] > 0]
    return {"edges": len(results), "errors": len(results) - len(ok),
            "first_error": next((r["error"] for r in results if "error" in r), None),
            "tokens_per_s": sum(len(r["tokens"]) for r in ok) / wall,
            "per_edge_tokens_per_s": statistics.median(per_edge) if per_edge else None,
            "p95_step_ms": p95, "tokens_per_round": (sum(len(r["tokens"]) for r in ok) /
                                                    max(1, sum(r["rounds"] for r in ok)))}


def _relay(upstream: str, delay_ms: float, conn) -> None:
    """A link emulator in a process of its own: sends its address, runs until told to stop."""
    from ...netem.relay import BackgroundLink
    from ...netem.shaping import LinkSpec

    with BackgroundLink(LinkSpec.symmetric(delay_ms=delay_ms), upstream) as link:
        conn.send(link.address)
        conn.recv()


class Relay:
    """A user-space link of a set round trip in front of `upstream` (RTT 0: no relay at all)."""

    def __init__(self, upstream: str, rtt_ms: float) -> None:
        self.address, self._proc, self._conn = upstream, None, None
        if rtt_ms > 0:
            ctx = multiprocessing.get_context("spawn")
            self._conn, child = ctx.Pipe()
            self._proc = ctx.Process(target=_relay, args=(upstream, rtt_ms / 2, child), daemon=True)
            self._proc.start()
            self.address = self._conn.recv()

    def close(self) -> None:
        if self._proc is not None:
            self._conn.send("stop")
            self._proc.join(timeout=10)


def capacity(upstream: str, fleet: EdgeFleet, vocab: int, edges: list[int], agrees: list[float], rtts: list[float],
             gamma: int, draft_ms: float, new_tokens: int, prompt_len: int, progress=print) -> list[dict]:
    """Rows of (RTT, edges, mode) with summarise's figures; hybrid rows also count the tokens that
    differ from the cloud-only run of the same prompts (0 when verification is exact)."""
    rows = []
    fleet.warm_up(upstream, vocab)
    for rtt in rtts:
        relay = Relay(upstream, rtt)
        try:
            for n in edges:
                rng = random.Random(n)
                prompts = [tuple(rng.randrange(vocab) for _ in range(prompt_len)) for _ in range(n)]
                jobs = [EdgeJob(relay.address, p, new_tokens, vocab, seed=i) for i, p in enumerate(prompts)]
                results, wall = fleet.run(jobs)
                rows.append({"rtt_ms": rtt, "edges": n, "mode": "cloud-only", **summarise(results, wall)})
                refs = [tuple(r.get("tokens", ())) for r in results]
                for agree in agrees:
                    hybrid = [EdgeJob(relay.address, p, new_tokens, vocab, ref, agree, gamma, draft_ms, seed=i)
                              for i, (p, ref) in enumerate(zip(prompts, refs))]
                    out, wall = fleet.run(hybrid)
                    differing = sum(a != b for ref, r in zip(refs, out) for a, b in zip(ref, r.get("tokens", ())))
                    rows.append({"rtt_ms": rtt, "edges": n, "mode": f"hybrid a={agree}", "agree": agree,
                                 "differing_tokens": differing, **summarise(out, wall)})
                progress(f"  RTT {rtt:g} ms, {n} edges: " + ", ".join(
                    f"{r['mode']} {r['tokens_per_s']:.0f} tok/s" for r in rows if r["edges"] == n and r["rtt_ms"] == rtt))
        finally:
            relay.close()
    return rows
