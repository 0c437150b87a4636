"""Part (d): N edges against one GPU verifier through real gRPC (the process backend by default, or the
in-process one; the GPU machine has no Ray), cloud-only against hybrid, measured in steady state.

Every edge runs closed-loop until a common deadline: when its generation ends it starts the next of
its prompts, so the replica carries N edges the whole time, and tokens are counted only in a window
that starts after a warm-up (connections, first prefills, the first batches forming) and ends at
the deadline, where every edge is still busy (no tail of a few late edges in small batches). Figures
per run: committed tokens/s of all edges with a 95 % interval (from the window cut into equal parts),
each edge's tokens/s (median, and the mean with its 95 % interval), the p95 of the replica's step
time (StepTimes: a step that ran a pass, wall time) and of the gap between an edge's commits (a round,
or a streamed token), the fewest tokens any edge committed in the window, the iteration-token
histogram the replica's Telemetry kept over the window (tokens per forward pass), and the cores the
front door's process used over the window (with the verifier in a process of its own, the front
door's gRPC alone: the ceiling to watch beside the ratio).

Cloud-only edges stream the target's tokens with the Generate RPC; their complete generations are
the references. Hybrid edges open a session per prompt and send rounds of γ drafts. The drafter is an
oracle that knows the reference: it proposes the right token with probability α, or it replays a real
drafter's agreement trace (bench/drafter_quality.py trace: where the shipped drafter agreed with the
target, position by position), so the acceptance by position and its runs are a real drafter's. γ is
fixed or chosen by the edge's own policy (edge/policy.py) from the replica's measured pass costs.
Each hybrid token is compared with the reference: verification is exact when none differs. Drafting
costs `draft_ms` per token, as on an edge device. Edges run as threads in a few worker processes,
so client-side Python does not share the server's interpreter. Links are emulated with the
user-space relay (netem/relay.py): RTT = 2 × delay.
"""
from __future__ import annotations

import json
import math
import multiprocessing
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ...common.protocol.wire import DraftBlock, GenerateSpec, SessionSpec

TRACE = Path(__file__).resolve().parents[2] / "docs" / "engine" / "acceptance-trace-smollm2.json"
WINDOW_PARTS = 10  # the window is cut into this many equal parts for the aggregate's interval
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 15: 2.13,
       20: 2.09, 30: 2.04}  # Student's t, two-sided 95 %, by degrees of freedom (1.96 beyond 30)


@dataclass(frozen=True)
class EdgeJob:
    """What one edge does in one run."""

    address: str
    prompts: tuple[tuple[int, ...], ...]  # cycled through until the deadline
    new_tokens: int
    vocab: int
    deadline: float  # time.time() at which the edge stops (mid-generation if it must)
    references: tuple[tuple[int, ...], ...] = ()  # per prompt, cloud-only's tokens (empty: decode cloud-only)
    agree: float = 0.0  # the oracle's α, when no trace is given
    flags: str = ""  # a drafter's agreement trace, "1" where it agreed, replayed from `seed`'s offset
    gamma: int = 4
    draft_ms: float = 0.0
    seed: int = 0


def run_edge(job: EdgeJob, start: threading.Barrier | None = None) -> dict:
    """One edge, closed-loop until its deadline: its commits (wall time, tokens), each generation's
    tokens (prompt index, tokens) and its rounds."""
    from ...edge.client import VerifierClient

    commits: list[tuple[float, int]] = []
    outputs: list[tuple[int, list[int]]] = []
    usable = [i for i in range(len(job.prompts)) if not job.references or len(job.references[i]) >= job.new_tokens]
    rng = random.Random(job.seed)
    cursor = (job.seed * 7919) % max(1, len(job.flags))
    rounds = 0
    with VerifierClient(job.address, timeout_s=120.0) as client:
        if start is not None:
            start.wait()
        for turn in range(10 ** 9):
            if (turn and time.time() >= job.deadline) or not usable:  # one generation at least
                break
            index = usable[turn % len(usable)]
            prompt, tokens = job.prompts[index], []
            outputs.append((index, tokens))
            if not job.references:
                stream = client.generate(GenerateSpec(prompt, max_new_tokens=job.new_tokens))
                for token in stream:
                    tokens.append(token)
                    commits.append((time.time(), 1))
                    if time.time() >= job.deadline:
                        stream.close()
                        break
                continue
            reference = job.references[index]
            opened = client.open_session(SessionSpec("", prompt))
            committed, r = len(prompt), 0
            while len(tokens) < job.new_tokens and time.time() < job.deadline:
                at = len(tokens)
                time.sleep(job.draft_ms * job.gamma / 1e3)
                draft = []
                for d in range(job.gamma):
                    right = reference[at + d] if at + d < len(reference) else 0
                    agreed = job.flags[(cursor + d) % len(job.flags)] == "1" if job.flags else rng.random() < job.agree
                    draft.append(right if agreed else (right + 1) % job.vocab)
                result = client.verify(DraftBlock(opened.session_id, r, committed, tuple(draft)))
                new = draft[:result.num_accepted] + [result.next_token]
                committed += len(new)
                tokens += new
                commits.append((time.time(), len(new)))
                cursor += len(new)  # the trace advances as the replayed greedy rounds did
                r += 1
                rounds += 1
            client.close_session(opened.session_id)
    return {"commits": commits, "outputs": [(i, t[:job.new_tokens]) for i, t in outputs], "rounds": rounds}


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
        self.run([EdgeJob(address, ((1, 2, 3),), 2, vocab, deadline=0.0) for _ in range(self.processes)],
                 at=lambda: None, window=(0, 0))

    def run(self, jobs: list[EdgeJob], at: Callable[[], object],
            window: tuple[float, float]) -> tuple[list[dict], list]:
        """Every job at once; `at()` is called at each end of `window` (time.time() values) while they
        run. (Per-edge results in job order, what the two calls returned.)"""
        shares = [jobs[i::self.processes] for i in range(self.processes)]
        pending = self._pool.map_async(_worker, [s for s in shares if s])
        marks = []
        for moment in window:
            time.sleep(max(0.0, moment - time.time()))
            marks.append(at())
        parts = pending.get()
        results: list[dict] = [{}] * len(jobs)
        for p, part in enumerate(parts):
            for k, result in enumerate(part):
                results[p + k * self.processes] = result
        return results, marks

    def close(self) -> None:
        self._pool.close()
        self._pool.join()


def t95(df: int) -> float:
    """Student's t quantile for a two-sided 95 % interval (the nearest tabulated degrees of freedom below)."""
    if df > 30:
        return 1.96
    return T95[max(k for k in T95 if k <= max(1, df))]


def interval(values: Sequence[float]) -> tuple[float, float] | None:
    """The 95 % interval of the mean of `values` (None for fewer than two)."""
    if len(values) < 2:
        return None
    mean, half = statistics.fmean(values), t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean - half, mean + half


def summarise(results: list[dict], window: tuple[float, float], parts: int = WINDOW_PARTS) -> dict:
    """Steady-state figures of one run over `window` (see the module doc)."""
    ok = [r for r in results if "error" not in r]
    begin, end = window
    span = end - begin
    per_edge, gaps, slices = [], [], [0] * parts
    for r in ok:
        inside = [(t, n) for t, n in r["commits"] if begin <= t < end]
        per_edge.append(sum(n for _, n in inside))
        stamps = [t for t, _ in r["commits"]]
        gaps += [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:]) if begin <= a and b < end]
        for t, n in inside:
            slices[min(parts - 1, int((t - begin) / span * parts))] += n
    rates = [n / span for n in per_edge]
    part_rates = [n / (span / parts) for n in slices]
    committed = sum(n for r in ok for _, n in r["commits"])
    return {"edges": len(results), "errors": len(results) - len(ok),
            "first_error": next((r["error"] for r in results if "error" in r), None),
            "window_s": round(span, 2), "tokens_per_s": sum(per_edge) / span if span > 0 else 0.0,
            "tokens_per_s_95": interval(part_rates),
            "per_edge_tokens_per_s": statistics.median(rates) if rates else None,
            "per_edge_mean_95": interval(rates), "min_edge_tokens": min(per_edge, default=0),
            "p95_gap_ms": _p95(gaps),
            "tokens_per_round": committed / max(1, sum(len(r["commits"]) for r in ok))}


def _p95(values: Sequence[float]) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] if ordered else None


class StepTimes:
    """The replica's steps that ran a pass, as its verifier's StepClock timed them (cloud/core/telemetry.py:
    from taking the queues to the answers, so on a GPU the pass has finished within it). `ends()` returns
    every step's (time.time() at its end, milliseconds) so far."""

    def __init__(self, ends: Callable[[], list[tuple[float, float]]]) -> None:
        self.ends = ends

    def p95_ms(self, window: tuple[float, float]) -> float | None:
        """The p95 of the steps that ended inside `window`."""
        return _p95([ms for end, ms in self.ends() if window[0] <= end < window[1]])


@dataclass(frozen=True)
class Replica:
    """Part (d)'s replica as a recipe that pickles: random weights of `shape`, a verifier that batches every
    edge's rounds, and its pass costs (one session's and, for the edges' policy, those of the batch sizes
    `sessions`) in its `info`. Built in the front door's process over the engine parts (a) and (c) used, or
    in a process of its own (cloud/pool/process_replica.py: gRPC off the model loop's interpreter)."""

    shape: str
    device: str
    dtype: object  # a torch.dtype
    limits: object  # VerifierLimits
    options: object  # EngineOptions
    max_batch: int
    hold: object  # Hold
    gamma: int
    sessions: tuple[int, ...]

    def verifier(self, measured: Callable | None = None, bench=None):
        """The verifier over `bench`'s engine (models.build's), or over one built here; its costs measured
        before it serves (`measured`, a process replica's callback, is not needed then)."""
        from ...cloud.core.costs import measure_batch_costs
        from ...cloud.core.verifier import Verifier
        from .models import build

        bench = bench or build(self.shape, self.device, self.dtype, self.limits, options=self.options)
        verifier = Verifier(bench.verifier.target, self.limits, bench.engine, max_batch=self.max_batch,
                            max_wait_ms=1.0, hold=self.hold)
        verifier.measure_pass_costs(self.gamma + 5)
        verifier.publish_pass_costs(verifier.info.pass_costs, measure_batch_costs(
            bench.engine, verifier.info.vocab_size, self.gamma + 5, self.sessions))
        return verifier


def serve(replica: Replica, backend: str, bench=None) -> tuple:
    """`replica` behind a real gRPC front door in this process: (the BackgroundServer, what it serves, its
    telemetry now (a callable: cloud/core/telemetry.py ReplicaTelemetry, None if it does not answer),
    StepTimes). backend "inprocess": the verifier over `bench` in this process; "process": in a child
    process of its own."""
    from ...cloud.api.server import BackgroundServer
    from ...cloud.core.telemetry import StepClock

    if backend == "inprocess":
        verifier = replica.verifier(bench=bench)
        verifier.clock = StepClock()
        server = BackgroundServer(verifier)
        return (server, verifier.info, lambda: server.call(verifier.astats()).telemetry,
                StepTimes(lambda: verifier.clock.ends))
    from ...cloud.pool.process_replica import process_pool

    pool = process_pool(replica.verifier, replica.limits.max_sessions, replica.limits.max_sessions)
    server, child = BackgroundServer(pool), pool.replicas["process"]
    server.call(child.step_clock(True))
    ends: list[tuple[float, float]] = []

    def child_ends() -> list[tuple[float, float]]:
        """The child's step ends so far: its clock taken and a fresh one started (a step in between is lost)."""
        clock, _ = server.call(child.step_clock(False))
        server.call(child.step_clock(True))
        ends.extend(clock.ends)
        return ends

    return (server, child.model_info(), lambda: getattr(server.call(child.astats()), "telemetry", None),
            StepTimes(child_ends))


def references(results: list[dict], prompts: int, new_tokens: int) -> list[tuple[tuple[int, ...], ...]]:
    """Per edge, per prompt, the first complete cloud-only generation of it (empty where none finished)."""
    refs = []
    for r in results:
        mine = [()] * prompts
        for index, tokens in r.get("outputs", []):
            if len(tokens) >= new_tokens and not mine[index]:
                mine[index] = tuple(tokens)
        refs.append(tuple(mine))
    return refs


def differing(refs: list[tuple[tuple[int, ...], ...]], results: list[dict]) -> tuple[int, int]:
    """(tokens that differ from the reference, tokens compared) over every hybrid generation."""
    diff = compared = 0
    for mine, r in zip(refs, results):
        for index, tokens in r.get("outputs", []):
            diff += sum(a != b for a, b in zip(mine[index], tokens))
            compared += min(len(mine[index]), len(tokens))
    return diff, compared


def load_trace(path: Path = TRACE) -> dict:
    """A recorded acceptance trace (bench/drafter_quality.py trace): its flags joined, and its α by position."""
    trace = json.loads(path.read_text())
    return {"flags": "".join(trace["flags"]), "alpha_by_position": trace["by_gamma"]["8"]["alpha_by_position"],
            "agreement": trace["agreement"], "source": f"{path.name} ({trace['drafter']}, {trace['date']})"}


def policy_gamma(pass_costs: Sequence[tuple[int, float]], batch_costs: Sequence[tuple[int, int, float]],
                 alphas: Sequence[float], edges: int, draft_ms: float, rtt_ms: float, max_gamma: int = 8) -> int:
    """The γ the edge's policy (edge/policy.py) picks from the replica's measured costs (ms) when
    `edges` edges share it: t_v(γ) from the batch curve nearest that load, as an edge's estimates read it."""
    from ...edge.estimates import Estimates
    from ...edge.policy import Rates, choose_gamma, interpolate

    est = Estimates(max_gamma + 1)
    est.use_pass_costs(tuple(pass_costs), tuple(batch_costs))
    groups = sorted({b for b, _, _ in batch_costs})
    loaded = [b for b in groups if b <= edges] or groups
    t1 = interpolate(pass_costs, 1) / 1e3
    t_loaded = interpolate([(m, ms) for b, m, ms in batch_costs if b == loaded[-1]], 1) / 1e3 if loaded else t1
    curve = est.verify.curve(max_gamma, load=t_loaded / t1)
    alphas = list(alphas) + [alphas[-1]] * (max_gamma + 1 - len(alphas))
    rates = Rates(alphas=alphas, draft_s=draft_ms / 1e3, rtt_s=rtt_ms / 1e3, verify_single_s=curve[0],
                  verify_block_s=curve[0], verify_per_draft_s=0.0, cloud_token_s=t_loaded, verify_curve_s=curve)
    return max(1, choose_gamma(rates, max_gamma, pipelined=False))


@dataclass(frozen=True)
class Mode:
    """One kind of run: cloud-only, or hybrid with a drafter (oracle α or the trace) and a γ (fixed or
    the policy's)."""

    name: str
    agree: float = 0.0  # 0 and no trace: cloud-only
    trace: bool = False
    gamma: int = 4  # 0: the policy's
    rtts: tuple[float, ...] = (0.0,)

    @property
    def hybrid(self) -> bool:
        return self.trace or self.agree > 0


def capacity(upstream: str, fleet: EdgeFleet, vocab: int, edges: list[int], modes: list[Mode], draft_ms: float,
             new_tokens: int, prompt_len: int, warm_s: float, window_s: float, telemetry: Callable[[], object],
             costs: tuple[Sequence, Sequence] = ((), ()), trace: dict | None = None, prompts_per_edge: int = 8,
             steps: StepTimes | None = None, progress=print) -> list[dict]:
    """Rows of (RTT, edges, mode) with summarise's figures. Per RTT and edge count, cloud-only runs
    first (its generations are the hybrid runs' references); hybrid rows count the tokens that differ
    from them. `telemetry()` returns the replica's telemetry (or None): the difference of its iteration-token
    histogram over the window is reported, and what its batching hold weighed at the window's end.
    `costs`: (pass_costs, batch_pass_costs) for the policy's γ."""
    from .report import hold_inputs, histogram_delta

    rows = []
    fleet.warm_up(upstream, vocab)
    for rtt in sorted({r for mode in modes for r in mode.rtts}):
        relay = Relay(upstream, rtt)
        try:
            for n in edges:
                rng = random.Random(n)
                prompts = [tuple(tuple(rng.randrange(vocab) for _ in range(prompt_len))
                                 for _ in range(prompts_per_edge)) for _ in range(n)]
                refs: list = []
                for mode in [m for m in modes if rtt in m.rtts]:
                    gamma = mode.gamma
                    alphas = (trace["alpha_by_position"] if mode.trace else [mode.agree]) if mode.hybrid else []
                    if mode.hybrid and not gamma:
                        gamma = policy_gamma(*costs, alphas, n, draft_ms, rtt)
                    began = time.time() + 1.0  # the workers' threads start within this
                    window = (began + warm_s, began + warm_s + window_s)
                    if mode.hybrid and not refs:
                        raise RuntimeError(f"mode {mode.name} needs a cloud-only run before it")
                    jobs = [EdgeJob(relay.address, prompts[i], new_tokens, vocab, window[1],
                                    refs[i] if mode.hybrid else (), mode.agree, trace["flags"] if mode.trace else "",
                                    gamma, draft_ms, seed=i) for i in range(n)]
                    results, marks = fleet.run(jobs, lambda: (telemetry(), time.process_time()), window)
                    before, after = (mark[0] for mark in marks)  # the replica's telemetry as the window began, ended
                    row = {"rtt_ms": rtt, "edges": n, "mode": mode.name, "gamma": gamma if mode.hybrid else None,
                           "alpha": ("trace" if mode.trace else mode.agree) if mode.hybrid else None,
                           **summarise(results, window), "p95_step_ms": steps.p95_ms(window) if steps else None,
                           "iteration_tokens": histogram_delta(before and before.iteration_tokens,
                                                               after and after.iteration_tokens),
                           "hold_inputs_ms": hold_inputs(after),
                           "front_door_cores": (marks[1][1] - marks[0][1]) / window_s}
                    if mode.hybrid:
                        row["differing_tokens"], row["compared_tokens"] = differing(refs, results)
                    else:
                        refs = references(results, prompts_per_edge, new_tokens)
                        row["reference_generations"] = sum(1 for mine in refs for r in mine if r)
                    rows.append(row)
                    progress(f"  RTT {rtt:g} ms, {n} edges, {mode.name}: {row['tokens_per_s']:.0f} tok/s, "
                             f"{row['min_edge_tokens']} tokens at least per edge, γ {row['gamma']}")
        finally:
            relay.close()
    return rows


def standard_modes(agrees: Sequence[float], gamma: int, rtt_hybrid: Sequence[float], with_trace: bool,
                   with_policy: bool, rtts: Sequence[float]) -> list[Mode]:
    """Cloud-only at every RTT; hybrid at α in `agrees` (RTT 0, and α = max(agrees) at `rtt_hybrid` too),
    the trace, and the policy's γ beside the fixed one."""
    top = max(agrees)
    modes = [Mode("cloud-only", rtts=tuple(rtts))]
    for a in agrees:
        modes.append(Mode(f"hybrid a={a}", agree=a, gamma=gamma,
                          rtts=(0.0, *[r for r in rtt_hybrid if r and r in rtts]) if a == top else (0.0,)))
    if with_trace:
        modes.append(Mode("hybrid trace", trace=True, gamma=gamma))
    if with_policy:
        modes.append(Mode(f"hybrid a={top}, policy γ", agree=top, gamma=0))
        if with_trace:
            modes.append(Mode("hybrid trace, policy γ", trace=True, gamma=0))
    return [replace(m, rtts=tuple(r for r in m.rtts if r in rtts)) for m in modes if any(r in rtts for r in m.rtts)]


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
