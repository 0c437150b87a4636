"""The hybridspec files and Python function frames on a steady-state verify round's path, edge and
cloud apart: how long the path a newcomer reads is (issue 41), counted rather than guessed.

A target is served in-process: `cloud/api/server.py:BackgroundServer` over a `Verifier`, a real gRPC
server on localhost. With --engine torch (the default) the target is a tiny random model
(tests/tinymodels.py) on the torch engine and rounds go through the front door. With --engine llamacpp
it is the embedded target on the llama.cpp engine, and rounds go to the verifier's own endpoint
(`start_verify_endpoint`, as a Ray replica's: direct verify), the default deployment's path. An
`EdgeWorker` drafting with the target's own weights (by default: every block is accepted whole, or
nearly on llama.cpp's quantised weights, so the rounds have the same shape; --drafter-seed 1 drafts
with another tiny model) generates greedily with a fixed γ (gamma_policy fixed, no pipelining, no
cloud-only switch, α_FB 0): every token goes through verify rounds of the same shape.

A profiler on every thread (sys.setprofile / threading.setprofile) counts each new frame of the
package's code; a generator's or coroutine's resumption is not a new frame and is not counted. A
method generated at run time (a dataclass's __init__ or __eq__) counts in its class's file, marked
"(generated)"; library code (grpc, torch, dataclasses.replace itself) does not count. Frames are
charged to the round running when they began (a round starts when
edge/generation.py:Generation.hybrid_round is entered), and the rounds counted are the steady ones:
all but the first (after the setup and the session's open) and the last (a shorter block, then the
teardown) of a generation run after an uncounted warm-up generation. The round reported is the typical one: each function with the median
of its frames over those rounds (`summarise`). A side is the process that runs the code: the edge's
threads, or the in-process cloud's.

Not every one of those files is read to follow the round: the path (`reading_path`) is the files whose
code hands the round on to another of the package's files; the rest are only looked up (a wire
dataclass, a maths rule, a metric, a layer of the model).

    python scripts/round_path.py [--engine torch|llamacpp] [--tokens 101] [--gamma 4] [--drafter-seed 0] [--out FILE]
"""
from __future__ import annotations

import collections
import dis
import inspect
import os
import sys
import tempfile
import threading
from pathlib import Path

# The benchmarks' harness: one result header and one tiny target for the repository's scripts too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from harness import arguments, header, median, report, tiny_target  # noqa: E402

PACKAGES = ("edge", "cloud", "common")  # the folders a round crosses; anything else counts as "other"
# The threads of the edge's process: the generation's own and its stream's reply reader
# (edge/client.py); every other thread here is the in-process cloud's (server loop, scheduler, gRPC).
EDGE_THREADS = ("MainThread", "verify-stream")
ROUND_START = ("edge/generation.py", "Generation.hybrid_round")
WRAPPERS = ("contextlib.py",)  # library frames between a caller and its callee: decorators (and torch's own)
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


class PathCounter:
    """Counts new frames of code under `root`, per (file, function), in the bucket of the round
    running when each began (bucket 0: before the first round)."""

    def __init__(self, root: Path) -> None:
        self.root = str(root) + os.sep
        self.round = 0
        # round -> (side, file, function) -> new frames; side: "edge" or "cloud", by the thread
        self.calls: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        # round -> (side, caller's file, callee's file) -> calls from one of the package's files into another
        self.handoffs: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.threads: set[str] = set()
        self._lock = threading.Lock()
        self._where: dict[object, tuple[str, str] | None] = {}  # code object -> (file, function) or None
        self._start: dict[object, int] = {}  # resumable code -> the offset where its frame first runs

    def _site(self, frame) -> tuple[str, str] | None:
        code = frame.f_code
        site = self._where.get(code, False)
        if site is False:
            site = self._file_site(code) if os.path.isabs(code.co_filename) else self._generated_site(frame)
            self._where[code] = site
        return site

    def _file_site(self, code) -> tuple[str, str] | None:
        path = self._inside(code.co_filename)
        return (path, code.co_qualname) if path else None

    def _generated_site(self, frame) -> tuple[str, str] | None:
        """A method generated at run time (a dataclass's __init__, __eq__, ...: each class gets code
        of its own) counts as its class's, in the class's file, when the class is the package's."""
        code = frame.f_code
        if not (code.co_argcount and code.co_varnames[0] == "self" and "self" in frame.f_locals):
            return None
        cls = type(frame.f_locals["self"])
        path = self._inside(getattr(sys.modules.get(cls.__module__), "__file__", None) or "")
        return (path, f"{cls.__qualname__}.{code.co_name} (generated)") if path else None

    def _inside(self, filename: str) -> str:
        """`filename` relative to the root when the package's own code is there, else ""."""
        path = os.path.realpath(filename) if os.path.isabs(filename) else ""
        inside = path.startswith(self.root) and os.sep + ".venv" + os.sep not in path
        return path[len(self.root):] if inside else ""

    def _first_entry(self, frame) -> bool:
        """False for a generator or coroutine resumed (3.11 reports each resumption as a call)."""
        code = frame.f_code
        if not code.co_flags & _RESUMABLE:
            return True
        if code not in self._start:
            self._start[code] = next(i.offset for i in dis.get_instructions(code) if i.opname == "RESUME")
        return frame.f_lasti == self._start[code]

    def __call__(self, frame, event, arg) -> None:
        if event != "call":
            return
        site = self._site(frame)
        if site is None or not self._first_entry(frame):
            return
        thread = threading.current_thread().name
        side = "edge" if thread in EDGE_THREADS else "cloud"
        caller = self._caller(frame)
        with self._lock:
            if site == ROUND_START:
                self.round += 1
            self.calls[self.round][(side, *site)] += 1
            if caller is not None and caller[0] != site[0]:
                self.handoffs[self.round][(side, caller[0], site[0])] += 1
            self.threads.add(thread.rstrip("0123456789_-"))

    def _caller(self, frame) -> tuple[str, str] | None:
        """The package's code that called `frame`: its immediate caller, seen through decorators
        (torch.no_grad, contextlib). A frame entered from other library code (grpc, asyncio, threading)
        was handed nothing by the package's own code."""
        back = frame.f_back
        while back is not None and back.f_code.co_filename.endswith(WRAPPERS):
            back = back.f_back
        return self._site(back) if back is not None else None

    def start(self) -> None:
        threading.setprofile(self)
        sys.setprofile(self)

    def stop(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


def package(path: str) -> str:
    """The package a file belongs to: its top folder, or "other"."""
    top = path.split(os.sep, 1)[0]
    return top if top in PACKAGES else "other"


def part(calls: dict[tuple[str, str], float]) -> dict:
    """Frames per round, distinct functions, and the files of `calls` ((file, function) -> frames)."""
    files = sorted({path for path, _ in calls})
    return {"frames_per_round": round(sum(calls.values()), 2), "functions": len(calls), "file_count": len(files),
            "files": files}


def reading_path(handoffs: dict[int, collections.Counter], rounds: list[int], files: list[str]) -> dict:
    """The files a round passes through, apart from those it only looks things up in: a file is on the
    path when, in most of `rounds` (more than half: what a timer does in every other round, such as the
    front door's metrics refresh, is not the round's), its code calls into another of the package's
    files; the others among `files` (wire dataclasses, maths, metrics, the model's layers) are only
    called. Per side, with the hand-offs (caller's file -> callee's file) that make the path."""
    keys = {key for r in rounds for key in handoffs.get(r, {})}
    typical = {key for key in keys if 2 * sum(bool(handoffs.get(r, {}).get(key)) for r in rounds) > len(rounds)}
    sides = {}
    for side in sorted({side for side, _, _ in typical}):
        edges = sorted((a, b) for s, a, b in typical if s == side)
        sides[side] = {"files": sorted({a for a, _ in edges}), "handoffs": [f"{a} -> {b}" for a, b in edges]}
    path = sorted({f for part in sides.values() for f in part["files"]})
    spine = sorted(set().union(*(spine_of([(a, b) for s, a, b in typical if s == side], *SPINE_ENDS[side])
                                 for side in sides if side in SPINE_ENDS)))
    return {"path_files": len(path), "path": path, "looked_up": sorted(set(files) - set(path)), "path_by_side": sides,
            "spine_files": len(spine), "spine": spine}


# Where a side's round starts, and the files that end its spine: the edge hands the round to the wire
# (the codec); the cloud takes it from the servicer and hands it to the engine (and its answer to the codec).
SPINE_ENDS = {
    "edge": ("edge/generation.py", ("common/protocol/codec.py",)),
    "cloud": ("cloud/api/service.py", ("common/protocol/codec.py", "cloud/engine/llamacpp_engine.py",
                                       "cloud/engine/torch_engine.py")),
}


def spine_of(handoffs: list[tuple[str, str]], start: str, ends: tuple[str, ...]) -> set[str]:
    """The files on a chain of hand-offs from `start` to one of `ends`: what a reader follows to see
    the round go from where it starts to the wire or the engine. A file the chain only calls for an
    answer (a decision, a metric, the drafter, a rule) is beside the spine, not on it."""
    callees: dict[str, set[str]] = collections.defaultdict(set)
    for a, b in handoffs:
        callees[a].add(b)
    reached, frontier = {start}, [start]
    while frontier:
        for b in callees[frontier.pop()] - reached:
            reached.add(b)
            frontier.append(b)
    leads = {f for f in ends if f in reached}  # the files from which an end is reachable, ends included
    changed = True
    while changed:
        changed = False
        for a in reached - leads:
            if callees[a] & leads:
                leads.add(a)
                changed = True
    return leads


def summarise(calls: dict[int, collections.Counter], rounds: list[int]) -> dict:
    """The typical round of `rounds`: each function with the median of its frames per round (rounds
    without it count 0), so that what happens in some rounds only, on a timer (the cloud's metrics
    refresh) or by the scheduler's timing, drops out; the mean over the rounds is given beside it. In
    all, by package (where the code lives) and by side (the process that runs it: a common/ function
    counts on the side that called it), with each function's frames per round, by side."""
    keys = {key for r in rounds for key in calls.get(r, {})}
    typical = {key: median([calls.get(r, {}).get(key, 0) for r in rounds]) for key in keys}
    mean = sum(calls.get(r, {}).total() for r in rounds) / len(rounds)
    typical = {key: frames for key, frames in typical.items() if frames}
    total, packages, sides = {}, collections.defaultdict(dict), collections.defaultdict(dict)
    for (side, path, fn), frames in typical.items():
        total[(path, fn)] = total.get((path, fn), 0) + frames
        packages[package(path)][(path, fn)] = packages[package(path)].get((path, fn), 0) + frames
        sides[side][(path, fn)] = frames
    everything = part(total)
    return {
        "rounds_counted": len(rounds),
        "frames_per_round": everything["frames_per_round"],
        "mean_frames_per_round": round(mean, 2),
        "functions": everything["functions"],
        "files": everything["file_count"],
        "by_side": {side: part(c) for side, c in sorted(sides.items())},
        "by_package": {p: part(c) for p, c in sorted(packages.items())},
        "calls_per_round": {side: {f"{path}:{fn}": frames for (path, fn), frames
                                   in sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))}
                            for side, c in sorted(sides.items())},
    }


def verifier_and_drafter(engine: str, drafter_seed: int, tmp: Path):
    """The verifier to serve and the edge's drafter: a tiny random pair on torch, or the embedded target
    on llama.cpp (as a replica loads it) drafted by its own torch weights."""
    from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
    from hybridspec.common.models.loading import load_model

    limits = VerifierLimits(max_context=512, max_draft=16, max_sessions=8, idle_timeout_s=600)
    if engine == "torch":
        target = load_model(tiny_target(tmp), device="cpu")
        drafter = load_model(tiny_target(tmp, drafter_seed, "drafter"), device="cpu")
        return Verifier(target, limits), drafter
    from hybridspec.cloud.engine.kinds import EngineKind
    from hybridspec.cloud.pool.loading import load_verifier
    from hybridspec.cloud.pool.specs import ReplicaSettings, ReplicaSpec
    from hybridspec.common.models.embedded import resolve

    target = resolve("", "target")
    settings = ReplicaSettings(engine=EngineKind.LLAMACPP, device="cpu", torch_threads=1, pass_cost_tokens=0)
    drafter = (load_model(target, device="cpu") if drafter_seed == 0 else
               load_model(tiny_target(tmp, drafter_seed, "drafter"), device="cpu"))
    return load_verifier(ReplicaSpec(target, settings, limits)), drafter


def count(tokens: int, gamma: int, prompt: list[int], drafter_seed: int = 0, engine: str = "torch") -> dict:
    """Serve a target in-process, generate twice (the first uncounted) and count the second's steady
    rounds."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    import hybridspec.edge
    from hybridspec.cloud.api.server import BackgroundServer, start_verify_endpoint
    from hybridspec.edge.client import VerifierClient
    from hybridspec.edge.config import EdgeConfig
    from hybridspec.edge.worker import EdgeWorker

    root = Path(hybridspec.edge.__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        verifier, drafter = verifier_and_drafter(engine, drafter_seed, Path(tmp))
    counter = PathCounter(root)
    counter.start()  # before the server's and client's threads start: they inherit it
    try:
        server = BackgroundServer(verifier)
        endpoint = None
        if engine == "llamacpp":  # direct verify: the open names the verifier's own endpoint
            endpoint = server.call(start_verify_endpoint(verifier, "127.0.0.1", "127.0.0.1"))
            verifier.verify_address = endpoint.address
        cfg = EdgeConfig.of(cloud=server.address, max_new_tokens=tokens, max_draft=gamma, gamma_policy="fixed",
                            cloud_only_switch=False, pipeline=False, fallback_threshold=0.0)
        try:
            with VerifierClient(server.address) as client:
                worker = EdgeWorker(drafter, client, cfg)
                worker.generate(prompt)  # warm-up: imports, first passes, caches
                counter.round = 0
                counter.calls.clear()
                counter.handoffs.clear()
                generation = worker.generate(prompt)
        finally:
            if endpoint is not None:
                server.call(endpoint.server.stop(0))
            server.stop()
    finally:
        counter.stop()
    rounds = generation.stats.rounds
    if counter.round != rounds or rounds < 3:
        raise SystemExit(f"counted {counter.round} round starts for {rounds} rounds: need 3 or more, "
                         "all hybrid (raise --tokens)")
    steady = list(range(2, rounds))
    summary = summarise(counter.calls, steady)
    return {"rounds": rounds, "tokens": len(generation.token_ids),
            "accepted_per_round": round(generation.stats.accepted / rounds, 2),
            "threads": sorted(counter.threads), "token_ids": generation.token_ids, **summary,
            **reading_path(counter.handoffs, steady, sorted({f for side in summary["by_side"].values()
                                                              for f in side["files"]}))}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--engine", choices=("torch", "llamacpp"), default="torch",
                        help="torch: a tiny random target, rounds through the front door (default); llamacpp: the "
                             "embedded target, rounds to the verifier's own endpoint (direct verify)")
    parser.add_argument("--tokens", type=int, default=101, help="tokens to generate (default 101)")
    parser.add_argument("--gamma", type=int, default=4, help="tokens drafted per round (default 4)")
    parser.add_argument("--drafter-seed", type=int, default=0,
                        help="the drafter's random weights (default 0: the target's own)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    prompt = [5, 17, 33, 80]
    result = count(args.tokens, args.gamma, prompt, args.drafter_seed, args.engine)
    engine = ("torch, tiny random models, in-process gRPC server" if args.engine == "torch" else
              "llamacpp, the embedded target, in-process gRPC server, direct verify on its own endpoint")
    report({**header(engine=engine, command=" ".join(["python", *sys.argv]), gamma=args.gamma,
                     drafter_seed=args.drafter_seed, prompt=prompt), **result}, args.out)


if __name__ == "__main__":
    main()
