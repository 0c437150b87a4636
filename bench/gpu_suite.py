"""The GPU suite: one command that measures the torch engine where the product can win.

    python bench/gpu_suite.py --out DIR                      # a GPU machine, about 6 minutes
    python bench/gpu_suite.py --out DIR --device cpu --quick  # the same code on a CPU, in a minute (CI runs it)
    taskset -c 1 python bench/gpu_suite.py --out DIR --device cpu --parts a   # pass times on one CPU core, fp32

Parts (lab/gpu_suite/): (a) pass time t(B sessions × M tokens) and v = t(5)/t(1); (b) for three model shapes with random bf16 weights (135M, 1B, 8B);
(c) exactness: hybrid chains and trees against cloud-only token ids, one session and 32 at once;
(d) capacity through real gRPC, N edges cloud-only against hybrid with an oracle drafter, at RTT 0
and 20 ms; and (k), on CUDA, each weight's product in our batch-invariant Triton kernel against
cuBLAS: time, and whether a row keeps its bits at every row count. Writes DIR/results.json (every number, with date, commit, device, versions), results.md
(headline figures against their goals, and tables) and results.png, after every part, so a run cut
short keeps what it measured. A part that fails is recorded in `errors` and the rest go on.
"""
from __future__ import annotations

import datetime
import gc
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridspec.cloud.core.limits import DEFAULT_HOLD, Hold
from hybridspec.cloud.core.verifier import VerifierLimits
from hybridspec.lab.gpu_suite import capacity, exactness, models, passes, report
from harness import arguments, commit

FULL = dict(shapes=["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"], batches=[1, 8, 32, 64],
            tokens=[1, 2, 4, 5, 8, 16], context=512, repeats=20, exact_shape="smollm2-135m",
            exact=[(1, 2048), (32, 64)], capacity_shape="llama-3.1-8b", edges=[1, 8, 32, 64], new_tokens=128,
            rtts=[0.0, 20.0], processes=8)
# A CPU is no place for the large shapes or many edges: the 135M shape, fp32, B = 1 and 8.
CPU = dict(FULL, shapes=["smollm2-135m"], batches=[1, 8], tokens=[1, 5], context=128, repeats=5)
QUICK = dict(shapes=["tiny"], batches=[1, 8], tokens=[1, 5], context=64, repeats=3, exact_shape="tiny",
             exact=[(1, 48), (4, 16)], capacity_shape="tiny", edges=[1, 4], new_tokens=16, rtts=[0.0, 20.0],
             processes=2)


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few points (a dry run, CI)")
    parser.add_argument("--parts", default="k,a,c,d", help="comma-separated: k (products: Triton against "
                                                           "cuBLAS, CUDA only), a (pass times; b is a over --shapes), "
                                                           "c (exactness), d (capacity)")
    parser.add_argument("--shapes", nargs="+", help="model shapes for (a): " + ", ".join(models.SHAPES))
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    parser.add_argument("--agree", type=float, nargs="+", default=[0.6, 0.8], help="oracle drafter agreement (d)")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--draft-ms", type=float, default=1.0, help="drafting time per token on the edge (d)")
    parser.add_argument("--hold", type=Hold, choices=list(Hold), default=DEFAULT_HOLD,
                        help="which rounds a queued round waits for (d; cloud/core/holding.py)")
    args = parser.parse_args(argv)
    plan = dict(QUICK if args.quick else FULL if args.device.startswith("cuda") else CPU)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.shapes:
        plan["shapes"] = args.shapes
    parts = set(args.parts.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    results: dict = {"meta": _meta(args, dtype), "plan": plan, "passes": {}, "exactness": {}, "errors": []}
    began = time.perf_counter()

    def save() -> None:
        results["meta"]["seconds"] = round(time.perf_counter() - began, 1)
        report.write_json(args.out, results)
        report.write_markdown(args.out, results)
        try:
            report.plot(args.out, results)
        except Exception as exc:  # a plot is never worth losing the numbers
            results["errors"].append(f"plot: {exc}")

    def step(name: str, fn) -> object:
        print(f"[{time.perf_counter() - began:6.1f} s] {name}", flush=True)
        try:
            return fn()
        except Exception as exc:
            results["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            return None
        finally:
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            save()

    limits = VerifierLimits(max_context=4096, max_draft=16, max_sessions=64, kv_cache_tokens=65536)
    # 0. The matrix products alone: what batch invariance costs against the library's kernels.
    if "k" in parts and args.device.startswith("cuda"):
        from hybridspec.lab.gpu_suite import kernels

        results["products"] = {}
        for shape in plan["shapes"]:
            step(f"(k) {shape}: products", lambda: results["products"].__setitem__(
                shape, kernels.products(shape, [1, 5, 64, 320, 1024])))
    # 1. Pass times.
    if "a" in parts:
        for shape in plan["shapes"]:
            step(f"(a) {shape}: torch engine", lambda: _passes(results, shape, plan, args.device, dtype, limits))
    # 2. Exactness of hybrid against cloud-only on the engine.
    if "c" in parts:
        step("(c) exactness", lambda: _exactness(results, plan, args.device, dtype, limits))
    # 3. Capacity through gRPC.
    if "d" in parts:
        step("(d) capacity", lambda: _capacity(results, plan, args, dtype, limits))
    print("\n".join(f"{a}: {b} (goal {c})" for a, b, c in report.headline(results)))
    print(f"done in {time.perf_counter() - began:.0f} s; {len(results['errors'])} error(s); {args.out}/results.md")
    return 1 if results["errors"] else 0


def _passes(results: dict, shape: str, plan: dict, device: str, dtype, limits) -> None:
    engine = models.build(shape, device, dtype, limits).engine
    results.setdefault("wide_tiles", {})[shape] = engine.wide_tiles  # check_tiles' verdict on this GPU
    rows = passes.time_passes(engine, models.SHAPES[shape]["vocab_size"], plan["batches"], plan["tokens"],
                              plan["context"], plan["repeats"])
    results["passes"].setdefault(shape, {})["torch"] = rows


def _exactness(results: dict, plan: dict, device: str, dtype, limits) -> None:
    bench = models.build(plan["exact_shape"], device, dtype, limits)
    for sessions, tokens in plan["exact"]:
        key = f"{plan['exact_shape']}, {sessions} session(s) × {tokens} tokens"
        results["exactness"][key] = exactness.exactness(bench.verifier, sessions, tokens, 32, 0.7, 8)
        print(f"  {key}: {results['exactness'][key]}", flush=True)


def _capacity(results: dict, plan: dict, args, dtype, limits) -> None:
    from hybridspec.cloud.api.server import BackgroundServer
    from hybridspec.cloud.core.verifier import Verifier

    bench = models.build(plan["capacity_shape"], args.device, dtype, limits)
    verifier = Verifier(bench.verifier.target, limits, bench.engine, max_batch=max(plan["edges"]), max_wait_ms=1.0,
                        hold=args.hold)
    verifier.measure_pass_costs(8)
    server = BackgroundServer(verifier)
    fleet = capacity.EdgeFleet(plan["processes"])
    results["capacity"] = {"shape": plan["capacity_shape"], "hold": args.hold.value, "gamma": args.gamma,
                           "draft_ms_per_token": args.draft_ms,
                           "new_tokens": plan["new_tokens"], "rows": []}
    try:
        results["capacity"]["rows"] = capacity.capacity(
            server.address, fleet, models.SHAPES[plan["capacity_shape"]]["vocab_size"], plan["edges"], args.agree,
            plan["rtts"], args.gamma, args.draft_ms, plan["new_tokens"], prompt_len=32)
    finally:
        fleet.close()
        server.stop()


def _meta(args, dtype) -> dict:
    def run(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            return ""

    cuda = args.device.startswith("cuda") and torch.cuda.is_available()
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": commit(),
            "device": args.device, "device_name": torch.cuda.get_device_name() if cuda else run("uname", "-m") + " CPU",
            "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "dtype": str(dtype).removeprefix("torch."), "python": sys.version.split()[0],
            "command": " ".join(["python", "bench/gpu_suite.py", *sys.argv[1:]])}


if __name__ == "__main__":
    sys.exit(main())
