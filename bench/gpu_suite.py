"""The GPU suite: one command that measures the torch engine where the product can win.

Parts (lab/gpu_suite/; docs/gpu.md): (k) each weight's product, first kernels, current ones and cuBLAS
(CUDA); (a) pass times t(B × M) of random-weight shapes; (c) hybrid chains and trees against cloud-only
token ids; (d) capacity of N closed-loop gRPC edges, cloud-only against hybrid. DIR/results.json,
results.md and results.png are written after every part; a part that fails goes to `errors`.
"""
from __future__ import annotations

import datetime
import gc
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridspec.cloud.core.costs import measure_batch_costs
from hybridspec.cloud.core.limits import DEFAULT_HOLD, Hold
from hybridspec.cloud.core.verifier import VerifierLimits
from hybridspec.cloud.engine.kinds import Products
from hybridspec.cloud.engine.torch_engine import EngineOptions
from hybridspec.lab.gpu_suite import capacity, exactness, models, passes, report
from harness import arguments, commit

FULL = dict(edges=[8, 64], new_tokens=128, prompt_len=32, warm_s=3.0, window_s=14.0, rtts=[0.0, 20.0], processes=8,
            agrees=[0.6, 0.8], trace=True, policy=True, rtt_hybrid=[20.0],
            shapes=["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"], batches=[1, 8, 32, 64],
            tokens=[1, 2, 4, 5, 8, 16], context=512, repeats=20, exact_shapes=["smollm2-135m"],
            exact=[(1, 2048), (32, 64)], capacity_shape="llama-3.1-8b", compare_split=True,
            product_shapes=["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"], product_rows=[1, 5, 64, 320, 512])
# Issue 53's goal rows, sized for one GPU session (≤ 6 minutes on an H100/H200; the budget per part is in
# docs/gpu.md): the 8B's products, its passes and the 135M's, old kernels beside new, exactness on both
# shapes, capacity at 64 edges only.
ISSUE53 = dict(FULL, shapes=["smollm2-135m", "llama-3.1-8b"], batches=[1, 8, 64], tokens=[1, 5], repeats=15,
               exact_shapes=["smollm2-135m", "llama-3.1-8b"], exact=[(1, 512), (32, 48)], edges=[64],
               window_s=13.0, product_shapes=["llama-3.1-8b"])
# A CPU is no place for the large shapes or many edges: the 135M shape, fp32, B = 1 and 8.
CPU = dict(FULL, shapes=["smollm2-135m"], batches=[1, 8], tokens=[1, 5], context=128, repeats=5, compare_split=False,
           edges=[4], warm_s=2.0, window_s=6.0, processes=2)
QUICK = dict(CPU, shapes=["tiny"], batches=[1, 8], tokens=[1, 5], context=64, repeats=3, exact_shapes=["tiny"],
             exact=[(1, 48), (4, 16)], capacity_shape="tiny", edges=[4], new_tokens=16, warm_s=1.0, window_s=2.5,
             prompt_len=8)
PRESETS = {"full": FULL, "issue53": ISSUE53}


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full", help="what a GPU run measures")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few points (a dry run, CI)")
    parser.add_argument("--parts", default="k,a,c,d", help="comma-separated: k (products: split, fused and cuBLAS, "
                                                           "CUDA only), a (pass times), c (exactness), d (capacity)")
    parser.add_argument("--shapes", nargs="+", help="model shapes for (a): " + ", ".join(models.SHAPES))
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    parser.add_argument("--gamma", type=int, default=4, help="γ of the fixed-γ hybrid runs (d)")
    parser.add_argument("--draft-ms", type=float, default=1.0, help="drafting time per token on the edge (d)")
    parser.add_argument("--window-s", type=float, help="the steady-state window of each capacity run (d)")
    parser.add_argument("--capacity-backend", choices=["process", "inprocess"], default="process",
                        help="(d): the verifier in a process of its own beside the front door, or inside it")
    parser.add_argument("--hold", type=Hold, choices=list(Hold), default=DEFAULT_HOLD,
                        help="which rounds a queued round waits for (d; cloud/core/holding.py)")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    plan = dict(QUICK if args.quick else PRESETS[args.preset] if cuda else CPU)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.shapes:
        plan["shapes"] = args.shapes
    if args.window_s:
        plan["window_s"] = args.window_s
    parts = set(args.parts.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if cuda else torch.float32
    results: dict = {"meta": _meta(args, dtype), "plan": plan, "passes": {}, "exactness": {}, "engines": {},
                     "errors": [], "seconds": {}}
    began = time.perf_counter()

    def save() -> None:
        results["meta"]["seconds"] = round(time.perf_counter() - began, 1)
        report.write_json(args.out, results)
        report.write_markdown(args.out, results)
        try:
            report.plot(args.out, results)
        except Exception as exc:  # a plot is never worth losing the numbers
            results["errors"].append(f"plot: {exc}")

    def step(name: str, fn) -> None:
        """A part: its time recorded, a failure in `errors`, what it left freed and the results saved."""
        print(f"[{time.perf_counter() - began:6.1f} s] {name}", flush=True)
        start = time.perf_counter()
        try:
            fn()
        except Exception as exc:
            results["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        finally:
            results["seconds"][name] = round(time.perf_counter() - start, 1)
            free_memory(cuda)
            save()

    limits = VerifierLimits(max_context=4096, max_draft=16, max_sessions=64, kv_cache_tokens=65536)
    suite = _Suite(results, plan, args, dtype, limits)
    # 0. The matrix products alone: the first kernels, the current ones and cuBLAS.
    if "k" in parts and cuda:
        from hybridspec.lab.gpu_suite import kernels

        results["products"] = {}
        for shape in plan["product_shapes"]:
            step(f"(k) {shape}: products", lambda: results["products"].__setitem__(
                shape, kernels.products(shape, plan["product_rows"])))
    # 1. Pass times, and each engine's start-up and pass costs.
    if "a" in parts:
        for shape in plan["shapes"]:
            step(f"(a) {shape}: passes", lambda: suite.passes(shape))
    # 2. Exactness of hybrid against cloud-only on the engine.
    if "c" in parts:
        for shape in plan["exact_shapes"]:
            step(f"(c) {shape}: exactness", lambda: suite.exactness(shape))
    # 3. Capacity through gRPC.
    if "d" in parts:
        step("(d) capacity", suite.capacity)
    print("\n".join(f"{a}: {b} (goal {c})" for a, b, c in report.headline(results)))
    print(f"done in {time.perf_counter() - began:.0f} s; {len(results['errors'])} error(s); {args.out}/results.md")
    return 1 if results["errors"] else 0


def free_memory(cuda: bool) -> None:
    """What a part or an engine left behind, collected (and on CUDA the cached blocks given back)."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


class _Suite:
    """The parts' work. Each shape's engine with the current kernels is built once and serves every part
    (start-up, tuning and graph capture are paid once per shape); the first kernels' engine shares its
    weights."""

    def __init__(self, results: dict, plan: dict, args, dtype, limits: VerifierLimits) -> None:
        self.results, self.plan, self.args, self.dtype, self.limits = results, plan, args, dtype, limits
        self.cuda = args.device.startswith("cuda")
        self._benches: dict[str, models.Bench] = {}  # per shape, the current kernels' verifier and engine

    def bench(self, shape: str, products: Products = Products.FUSED) -> models.Bench:
        """A verifier over an engine of `shape` with these products; its start-up recorded."""
        if products is Products.FUSED and shape in self._benches:
            return self._benches[shape]
        options = EngineOptions(products=products, blocks=(self.args.gamma + 1,))
        shared = self._benches.get(shape)
        bench = models.build(shape, self.args.device, self.dtype, self.limits, options=options,
                             weights=shared.engine.weights if shared else None)
        if products is Products.FUSED:
            self._benches[shape] = bench
        engine = bench.engine
        self.results["engines"][self.key(shape, products)] = {
            "products": (engine.products or "first kernels (split)") if self.cuda else "torch",
            "wide tiles (split)": engine.wide_tiles,
            "graphs": engine.graph_report.describe() if self.cuda else "none (CPU)",
            "graph report": asdict(engine.graph_report)}
        return bench

    def key(self, shape: str, products: Products) -> str:
        """The engine's entry in results["engines"]."""
        return f"{shape} ({products.value})" if self.cuda else shape

    def passes(self, shape: str) -> None:
        plan, vocab = self.plan, models.SHAPES[shape]["vocab_size"]
        kinds = [Products.FUSED, Products.SPLIT] if self.cuda and plan["compare_split"] else [Products.FUSED]
        for products in kinds:
            engine = self.bench(shape, products).engine
            rows = passes.time_passes(engine, vocab, plan["batches"], plan["tokens"], plan["context"], plan["repeats"])
            self.results["passes"].setdefault(shape, {})[products.value if self.cuda else "torch"] = rows
            if products is Products.FUSED:
                sessions = tuple(b for b in plan["batches"] if b > 1)
                self.results["engines"][self.key(shape, products)]["batch pass costs (B, M, ms)"] = \
                    measure_batch_costs(engine, vocab, self.args.gamma + 1, sessions)
            del engine
            free_memory(self.cuda)

    def exactness(self, shape: str) -> None:
        bench = self.bench(shape)
        for sessions, tokens in self.plan["exact"]:
            key = f"{shape}, {sessions} session(s) × {tokens} tokens"
            self.results["exactness"][key] = exactness.exactness(bench.verifier, sessions, tokens, 32, 0.7, 8)
            print(f"  {key}: {self.results['exactness'][key]}", flush=True)

    def capacity(self) -> None:
        plan, args = self.plan, self.args
        shape = plan["capacity_shape"]
        vocab = models.SHAPES[shape]["vocab_size"]
        # The replica: the shape's engine behind a verifier that batches every edge's rounds, in this process
        # (sharing the engine of parts (a) and (c)) or in one of its own (which builds its own: freed here).
        sessions = tuple(sorted({b for b in (*plan["edges"], 8, 64) if 1 < b <= max(plan["edges"])}))
        replica = capacity.Replica(shape, args.device, self.dtype, self.limits, EngineOptions(
            products=Products.FUSED, blocks=(args.gamma + 1,)), max(plan["edges"]), args.hold, args.gamma, sessions)
        if args.capacity_backend == "process":
            self._benches.pop(shape, None)
            free_memory(self.cuda)
        server, info, telemetry, steps = capacity.serve(
            replica, args.capacity_backend, self.bench(shape) if args.capacity_backend == "inprocess" else None)
        costs = (info.pass_costs, info.batch_pass_costs)  # what an edge reads from GetModelInfo
        trace = capacity.load_trace() if plan["trace"] else None
        modes = capacity.standard_modes(plan["agrees"], args.gamma, plan["rtt_hybrid"], plan["trace"], plan["policy"],
                                        plan["rtts"])
        fleet = capacity.EdgeFleet(plan["processes"])
        self.results["capacity"] = {"shape": shape, "backend": args.capacity_backend, "hold": args.hold.value,
                                    "draft_ms_per_token": args.draft_ms, "new_tokens": plan["new_tokens"],
                                    "warm_s": plan["warm_s"], "window_s": plan["window_s"],
                                    "trace": trace and {k: v for k, v in trace.items() if k != "flags"},
                                    "pass_costs": costs[0], "batch_pass_costs": costs[1], "rows": []}
        try:
            self.results["capacity"]["rows"] = capacity.capacity(
                server.address, fleet, vocab, plan["edges"], modes, args.draft_ms, plan["new_tokens"],
                plan["prompt_len"], plan["warm_s"], plan["window_s"], telemetry, costs, trace, steps=steps)
        finally:
            fleet.close()
            server.stop()


def _meta(args, dtype) -> dict:
    cuda = args.device.startswith("cuda") and torch.cuda.is_available()
    try:
        import triton
    except ImportError:
        triton = None
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit(), "device": args.device,
            "device_name": torch.cuda.get_device_name() if cuda else platform.machine() + " CPU",
            "torch": torch.__version__, "triton": triton and triton.__version__, "cuda": torch.version.cuda,
            "dtype": str(dtype).removeprefix("torch."), "python": sys.version.split()[0],
            "cublas_env": {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")},
            "command": " ".join(["python", "bench/gpu_suite.py", *sys.argv[1:]])}


if __name__ == "__main__":
    sys.exit(main())
