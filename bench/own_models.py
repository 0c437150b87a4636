"""A user's own GGUF pair given as bare files (no tokenizer beside them): what starting a cloud and an
edge on them costs, where the cloud's memory goes, and how well `pair check` predicts hybrid decoding.

A process tree is sampled every 50 ms (peak resident memory, by process at the peak; CPU seconds; whether
a process mapped the drafter's file). The GGUF tokenizers and pass-cost curves kept from an earlier use
are removed first, so the first start and the first edge include reading them. A larger target of a real
model's sizes: scripts/shaped_gguf.py.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import psutil

from harness import EDGE_CORE, arguments, other_vocabulary_gguf, cloud as cloud_on_core, commit, header, pin, report, usable_cores

from hybridspec.cloud.process import parse_ready_line
from hybridspec.common.models.embedded import default_paths, resolve
from hybridspec.lab.pairs import PairCheckConfig, _encode, check, load_prompts

PROMPT = "def fibonacci(n):"
NEW_TOKENS = 32
SMALL_KV = {"kv_streams": 1, "max_context": 2048, "kv_cache_tokens": 2048, "prefix_cache_tokens": 0,
            "max_sessions": 4, "metrics_port": -1, "port": 0}
LLAMA_LOAD = """
import sys, time
t = time.perf_counter()
import llama_cpp as llama
quiet = llama.llama_log_callback(lambda *a: None)  # kept alive: llama.cpp holds the pointer
llama.llama_log_set(quiet, None)
llama.llama_backend_init()
model = llama.llama_model_load_from_file(sys.argv[1].encode(), llama.llama_model_default_params())
params = llama.llama_context_default_params()
params.n_ctx = int(sys.argv[2])
ctx = llama.llama_init_from_model(model, params)
print(time.perf_counter() - t)
"""

# `memory`: cloud serve --backend inprocess's steps (cli/cloud_cmd.py run_serve, cloud/pool/replica.py
# load_verifier), each followed by a line of JSON: its resident and anonymous memory and heavy imports.
START_STEPS = """
import json, sys
HEAVY = ("numpy", "llama_cpp", "torch", "tokenizers", "transformers", "grpc", "ray")
def step(name):
    kb = {l.split()[0]: int(l.split()[1]) for l in list(open("/proc/self/smaps_rollup"))[1:]}
    print(json.dumps({"step": name, "rss_mib": round(kb["Rss:"] / 1024, 1), "anonymous_mib":
                      round(kb["Anonymous:"] / 1024, 1), "imported": [m for m in HEAVY if m in sys.modules]}), flush=True)
step("python")
from hybridspec.cli import cloud_cmd, main
config = cloud_cmd.serve_config(main.build_parser().parse_args(["cloud", "serve", "--config", sys.argv[1]]))
step("the CLI and its config")
from hybridspec.cloud.engine.factory import load_engine, pick_engine
spec = config.replica_spec(config.server.target)
s = spec.settings
pick_engine(spec.target, s.engine, s.device, s.dtype, config.limits.max_sessions)
step("the engine picked (llama-cpp-python, numpy)")
import torch
step("torch imported (the verifier's maths)")
target, engine = load_engine(spec.target, s.engine, s.device, s.dtype, s.torch_threads, spec.limits)
step("llama.cpp: the model and its contexts (the sessions', the draft trees')")
from hybridspec.cloud.core.verifier import Verifier
verifier = Verifier(target, spec.limits, engine, max_batch=s.max_batch_size, max_wait_ms=s.max_wait_ms,
                    prefill_budget_ms=s.prefill_budget_ms)
step("the verifier (its ModelInfo: the tokenizer's fingerprint)")
from hybridspec.cloud.api.server import serve_forever
step("the gRPC server imported")
sys.stdin.read()  # held until the parent has read /proc/PID/smaps
"""


CURVE_WAIT_S = 600  # how long a start's pass-cost curve is waited for


def bare_copy(src: Path, into: Path) -> Path:
    """`src` alone in the empty directory `into` (a hard link where the file system allows, else a copy)."""
    into.mkdir(parents=True)
    dst = into / src.name
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
    return dst


class Watch:
    """A command run to its end (or to a line on stdout), its process tree sampled every 50 ms: the
    peak of the tree's summed resident memory, and whether any process of it mapped `watched`."""

    def __init__(self, cmd: list[str], watched: Path | None = None, ready_line=None) -> None:
        self.watched = str(watched.resolve()) if watched else None
        self.peak_mib = 0.0
        self.at_peak: dict[str, float] = {}  # MiB per process (by what it runs) when the tree peaked
        self.cpu_s = 0.0  # CPU seconds (user + system) of the tree: what the work costs whatever else runs
        self.touched = False
        self.ready_s: float | None = None
        self.lines: list[str] = []
        start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._ready = threading.Event()
        self._err: list[str] = []
        readers = [threading.Thread(target=self._read, args=(ready_line, start), daemon=True),
                   threading.Thread(target=lambda: self._err.extend(self.proc.stderr), daemon=True)]
        for r in readers:
            r.start()
        while self.proc.poll() is None and not self._ready.is_set():
            self._sample()
            time.sleep(0.05)
        self.wall_s = time.perf_counter() - start
        self._sample()
        if self.proc.poll() is not None:
            for r in readers:
                r.join(timeout=10)

    def _read(self, ready_line, start: float) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if ready_line is not None and ready_line(line):
                self.ready_s = time.perf_counter() - start
                self._ready.set()

    def sample_until(self, done, timeout_s: float) -> float | None:
        """Go on sampling until `done()`; the seconds since the start when it was, or None (timed out, or
        the process ended)."""
        deadline = time.perf_counter() + timeout_s
        start = time.perf_counter() - self.wall_s
        while self.proc.poll() is None and time.perf_counter() < deadline:
            self._sample()
            if done():
                return time.perf_counter() - start
            time.sleep(0.05)
        return None

    def _sample(self) -> None:
        try:
            root = psutil.Process(self.proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        total, cpu, each = 0, 0.0, {}
        for p in tree:
            try:
                rss = p.memory_info().rss
                total += rss
                label = _label(p.cmdline())
                each[label] = each.get(label, 0) + rss
                times = p.cpu_times()
                cpu += times.user + times.system
                if self.watched and not self.touched:
                    self.touched = self._uses(p.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        if total / 2**20 > self.peak_mib:
            self.peak_mib = total / 2**20
            self.at_peak = {k: round(v / 2**20, 1) for k, v in sorted(each.items(), key=lambda kv: -kv[1])}
        self.cpu_s = max(self.cpu_s, cpu)

    def _uses(self, pid: int) -> bool:
        """The file is mapped into the process: its weights loaded (llama.cpp and transformers' GGUF loader
        both map the file; reading its header does not)."""
        try:
            return self.watched in Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            return False

    @property
    def stderr(self) -> str:
        return "".join(self._err)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _label(cmdline: list[str]) -> str:
    """A process by what it runs: Ray's worker title, a Python script or module, or a binary's name."""
    if not cmdline:
        return "?"
    if cmdline[0].startswith("ray::"):
        return cmdline[0].split()[0]
    if "-m" in cmdline[:-1]:
        return " ".join(cmdline[cmdline.index("-m") + 1:cmdline.index("-m") + 5])
    script = next((Path(a).name for a in cmdline[1:] if a.endswith(".py")), "")
    return script or Path(cmdline[0]).name


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hybridspec.cli.main", *args]


def cloud(target: Path, backend: str, **extra) -> tuple[Watch, dict]:
    """Start `cloud serve` on the bare target; (the running Watch, what its start cost, and then what
    reporting the pass-cost curve cost, unless pass_cost_tokens is 0)."""
    keys = {**SMALL_KV, "target": str(target), "backend": backend, **extra}
    config = Path(tempfile.mkstemp(prefix="own-models-", suffix=".json")[1])
    config.write_text(json.dumps(keys))
    w = Watch(cli("cloud", "serve", "--config", str(config)), ready_line=parse_ready_line)
    if w.ready_s is None:
        raise RuntimeError(f"cloud serve ({backend}) did not start: {w.stderr[-2000:]}")
    size = target.stat().st_size
    out = {"ready_s": round(w.ready_s, 2), "cpu_s": round(w.cpu_s, 2), "peak_tree_rss_mib": round(w.peak_mib, 1),
           "peak_rss_over_file": round(w.peak_mib * 2**20 / size, 2), "peak_by_process_mib": w.at_peak}
    if backend == "inprocess":
        out["rss_at_ready_mib"] = memory_map(w.proc.pid, target)
    if extra.get("pass_cost_tokens", 1):
        curve_s = w.sample_until(lambda: bool(_curve(w)), CURVE_WAIT_S)
        out.update(curve_s=curve_s and round(curve_s, 2), cpu_s_until_curve=round(w.cpu_s, 2),
                   peak_until_curve_mib=round(w.peak_mib, 1), peak_until_curve_over_file=round(w.peak_mib * 2**20 / size, 2))
    return w, out


def _curve(w: Watch) -> tuple:
    """The pass-cost curve the running cloud reports (() while it has none, or while it does not answer:
    on a busy machine a call may time out while the replica measures)."""
    from hybridspec.common.protocol.errors import HybridSpecError
    from hybridspec.edge.client import VerifierClient

    address = parse_ready_line(next(line for line in w.lines if parse_ready_line(line)))
    try:
        with VerifierClient(address) as client:
            return client.model_info().pass_costs
    except HybridSpecError:
        return ()


def memory_map(pid: int, target: Path) -> dict:
    """The process's resident memory by what backs it (/proc/PID/smaps): the target's file, torch's
    libraries, other files, and anonymous memory (heaps, llama.cpp's KV and buffers, Python's objects)."""
    parts = {"target_file": 0, "torch_libraries": 0, "other_files": 0, "anonymous": 0}
    backing = "anonymous"
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            path = fields[5] if len(fields) > 5 else ""
            backing = ("target_file" if path == str(target.resolve()) else
                       "torch_libraries" if "/torch/lib/" in path else
                       "other_files" if path.startswith("/") else "anonymous")
        elif fields[0] == "Rss:":
            parts[backing] += int(fields[1])
    return {k: round(v / 1024, 1) for k, v in parts.items()}


def kv_cells_mib(target: Path) -> dict:
    """What the cloud's KV cells take for this target (f16 keys and values): the KV pool (SMALL_KV: one
    stream of max_context cells) and the draft-tree context (as many cells: one stream of them)."""
    from hybridspec.common.models.gguf_file import read_header

    meta = read_header(target).metadata
    arch = meta["general.architecture"]
    layers, hidden = meta[f"{arch}.block_count"], meta[f"{arch}.embedding_length"]
    heads = meta[f"{arch}.attention.head_count"]
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    per_token = layers * 2 * kv_heads * (hidden // heads) * 2
    pool = SMALL_KV["max_context"] * per_token / 2**20
    return {"kv_pool": round(pool, 1), "tree_context": round(pool, 1)}


def edge(address: str, drafter: Path, *flags: str) -> dict:
    """One `edge generate --json` with the bare drafter: wall minus generation, and whether it was loaded."""
    w = Watch(cli("edge", "generate", "--cloud", address, "--drafter", str(drafter), "--prompt", PROMPT,
                  "--max-new-tokens", str(NEW_TOKENS), "--json", *flags), watched=drafter)
    if w.proc.returncode != 0:
        return {"error": w.stderr.strip().splitlines()[-1:] or ["exit status %d" % w.proc.returncode]}
    out = json.loads(w.lines[-1])
    gen_s = out["stats"]["wall_s"]
    return {"wall_s": round(w.wall_s, 2), "cpu_s": round(w.cpu_s, 2), "generation_s": round(gen_s, 2),
            "wall_minus_generation_s":
            round(w.wall_s - gen_s, 2), "drafter_mapped": w.touched, "peak_rss_mib": round(w.peak_mib, 1),
            "tokens": len(out["token_ids"]), "rounds": out["stats"].get("rounds", 0), "token_ids": out["token_ids"]}


def measure(target: Path, drafter: Path, ray: bool, edges: bool) -> dict:
    """The starts: a first one, a second that finds the curve the first kept, and one measuring no curve."""
    out: dict = {}
    w, out["cloud_inprocess"] = cloud(target, "inprocess")
    try:
        address = parse_ready_line(next(line for line in w.lines if parse_ready_line(line)))
        if edges:
            out["edge_cloud_only_first"] = edge(address, drafter, "--cloud-only")
            out["edge_cloud_only"] = edge(address, drafter, "--cloud-only")
            out["edge_default"] = edge(address, drafter)
    finally:
        w.stop()
    w, out["cloud_inprocess_kept_curve"] = cloud(target, "inprocess")
    w.stop()
    w, out["cloud_inprocess_no_pass_costs"] = cloud(target, "inprocess", pass_cost_tokens=0)
    w.stop()
    if ray:
        w, out["cloud_ray"] = cloud(target, "ray")
        w.stop()
    return out


def mismatch(target: Path, work: Path) -> dict:
    """The error lines `pair check` and `edge generate` give a drafter of another vocabulary (this code)."""
    (work / "other").mkdir()
    other = other_vocabulary_gguf(work / "other" / "other.gguf")
    out = {}
    w, _ = cloud(target, "inprocess")
    try:
        address = parse_ready_line(next(line for line in w.lines if parse_ready_line(line)))
        for name, args in (("pair_check", ("pair", "check", "--target", str(target), "--drafter", str(other))),
                           ("edge_generate", ("edge", "generate", "--cloud", address, "--drafter", str(other),
                                              "--prompt", PROMPT))):
            run = Watch(cli(*args))
            out[name] = {"exit": run.proc.returncode, "stderr": run.stderr.strip(), "wall_s": round(run.wall_s, 2),
                         "peak_rss_mib": round(run.peak_mib, 1)}
    finally:
        w.stop()
    return out


def llama_alone(target: Path) -> dict:
    """llama.cpp's own load of the target into a context of SMALL_KV's size, in a fresh process."""
    w = Watch([sys.executable, "-c", LLAMA_LOAD, str(target), str(SMALL_KV["max_context"])])
    return {"process_wall_s": round(w.wall_s, 2), "cpu_s": round(w.cpu_s, 2), "load_s": round(float(w.lines[-1]), 2),
            "peak_rss_mib": round(w.peak_mib, 1), "peak_rss_over_file": round(w.peak_mib * 2**20 / target.stat().st_size, 2)}


def start(args) -> None:
    """Start costs of a bare pair."""
    shipped = default_paths()["target"]
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        target = bare_copy(Path(args.target) if args.target else shipped / "model.Q8_0.gguf", work / "target")
        if args.drafter:
            drafter = bare_copy(Path(args.drafter), work / "drafter")
        else:
            from hybridspec.common.models.drafter_gguf import export_drafter

            (work / "drafter").mkdir()
            drafter = export_drafter(default_paths()["drafter"], work / "drafter" / "drafter.gguf", log=lambda m: None)
        result = {**header(machine=f"{os.cpu_count()} cores, shared with other work"),
                  "target": f"{target.name} ({target.stat().st_size / 2**20:.0f} MiB), alone in a directory",
                  "drafter": f"{drafter.name} ({drafter.stat().st_size / 2**20:.0f} MiB), alone in a directory",
                  "cloud": f"cloud serve with {json.dumps({k: v for k, v in SMALL_KV.items() if k != 'port'})}",
                  "edge": f"edge generate --prompt {PROMPT!r} --max-new-tokens {NEW_TOKENS} --json",
                  "llama_cpp_alone": llama_alone(target), "kv_cells_mib": kv_cells_mib(target)}
        # A cache home of its own: the first start reads the file's tokenizer and measures its pass-cost
        # curve, as a user's first start does, and the user's own kept ones stay as they were.
        os.environ["HYBRIDSPEC_HOME"] = str(work / "home")
        result[f"{commit()} (this code)"] = measure(target, drafter, not args.no_ray, not args.no_edges)
        if not args.no_edges:
            result["mismatched_vocabulary"] = mismatch(target, work)
    report(result, args.out)


def memory(args) -> None:
    """The in-process start's resident memory step by step, beside llama.cpp's own load of the target;
    the tree context's share: the llama.cpp step once more with `max_tree_nodes: 0` (chains only)."""
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        target = bare_copy(Path(args.target) if args.target else default_paths()["target"] / "model.Q8_0.gguf",
                           work / "target")
        steps, backing = start_steps(target, work)
        chains, _ = start_steps(target, work, max_tree_nodes=0)
        size = target.stat().st_size
        result = {**header(machine=f"{os.cpu_count()} cores, shared with other work"),
                  "target": f"{target.name} ({size / 2**20:.0f} MiB), alone in a directory",
                  "cloud": f"cloud serve --backend inprocess's steps with {json.dumps({k: v for k, v in SMALL_KV.items() if k != 'port'})}",
                  "steps": steps, "rss_over_file": round(steps[-1]["rss_mib"] * 2**20 / size, 2),
                  "tree_context_mib": round(steps[4]["added_mib"] - chains[4]["added_mib"], 1),
                  "by_backing_mib": backing, "kv_cells_mib": kv_cells_mib(target), "llama_cpp_alone": llama_alone(target)}
    report(result, args.out)


def start_steps(target: Path, work: Path, **keys) -> tuple[list[dict], dict]:
    """START_STEPS in a fresh process: its steps (each with the MiB it added), and its memory by backing
    at the end."""
    config = work / "cloud.json"
    config.write_text(json.dumps({**SMALL_KV, "target": str(target), "backend": "inprocess", "pass_cost_tokens": 0,
                                  **keys}))
    proc = subprocess.Popen([sys.executable, "-c", START_STEPS, str(config)], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True)
    steps, backing = [], {}
    for line in proc.stdout:
        steps.append(json.loads(line))
        if steps[-1]["step"] == "the gRPC server imported":
            backing = memory_map(proc.pid, target)
            proc.stdin.close()  # the script waits for this to exit
            break
    proc.wait(timeout=60)
    for before, after in zip(steps, steps[1:]):
        after["added_mib"] = round(after["rss_mib"] - before["rss_mib"], 1)
    return steps, backing


def predict(args) -> None:
    """pair check's prediction against a measured run of the same pair."""
    if EDGE_CORE in usable_cores():
        pin(EDGE_CORE)
    # 1. The prediction.
    cfg = PairCheckConfig(target=args.target, drafter=args.drafter)
    started = time.perf_counter()
    predicted = check(cfg)
    check_s = time.perf_counter() - started
    # 2. The measured run.
    target = resolve(cfg.target, "target")
    with cloud_on_core({"target": target}) as (_, address):
        measured = measure_pair(address, cfg, args.repeats)
    ratio = measured["hybrid_tokens_per_s"] / measured["cloud_only_tokens_per_s"]
    speedup = predicted["here"]["speedup"]
    result = {**header(machine=f"{os.cpu_count()} cores, shared with other work"),
              "command": "python bench/own_models.py predict" + (f" --target {args.target}" if args.target else "")
                         + (f" --drafter {args.drafter}" if args.drafter else ""),
              "pair_check_seconds": round(check_s, 1), "pair_check": predicted,
              "measured": measured, "measured_ratio": round(ratio, 3), "predicted_ratio": speedup,
              "prediction_error": round(speedup / ratio - 1, 3)}
    report(result, args.out)


def measure_pair(address: str, cfg: PairCheckConfig, repeats: int) -> dict:
    """Forced hybrid and cloud-only edges over the running cloud, interleaved prompt by prompt."""
    from hybridspec.cli.edge_options import build_worker
    from hybridspec.edge.config import EdgeConfig

    target_dir = _tokenizer_dir(resolve(cfg.target, "target"))
    prompts = [_encode(target_dir, p) for p in load_prompts(cfg.prompts)]
    common = dict(cloud=address, drafter=resolve(cfg.drafter, "drafter"), max_new_tokens=cfg.new_tokens,
                  torch_threads=cfg.threads, max_draft=cfg.max_draft)
    workers = {"cloud_only": build_worker(EdgeConfig.of(**common, cloud_only=True)),
               "hybrid": build_worker(EdgeConfig.of(**common, cloud_only_switch=False))}
    try:
        runs: dict[str, list[tuple[int, float]]] = {mode: [] for mode in workers}
        texts: dict[str, dict[int, list[int]]] = {mode: {} for mode in workers}
        rounds = accepted = 0
        spent = {"wall_s": 0.0, "draft_s": 0.0, "cloud_s": 0.0, "gamma_sum": 0}
        for worker in workers.values():
            worker.generate(prompts[0])  # warm-up: the hybrid worker learns its rates here
        for _ in range(repeats):
            for i, prompt in enumerate(prompts):
                for mode in (("cloud_only", "hybrid") if i % 2 else ("hybrid", "cloud_only")):
                    gen = workers[mode].generate(prompt)
                    runs[mode].append((len(gen.token_ids), gen.stats.wall_s))
                    texts[mode][i] = gen.token_ids
                    if mode == "hybrid":
                        rounds, accepted = rounds + gen.stats.rounds, accepted + gen.stats.accepted
                        for key in spent:
                            spent[key] += getattr(gen.stats, key)
    finally:
        for worker in workers.values():
            worker.close()
    rate = {mode: sum(n for n, _ in r) / sum(s for _, s in r) for mode, r in runs.items()}
    per_prompt = [(n1 / s1) / (n0 / s0) for (n0, s0), (n1, s1) in zip(runs["cloud_only"], runs["hybrid"])]
    return {"prompts": len(prompts), "repeats": repeats, "new_tokens": cfg.new_tokens,
            "cloud_only_tokens_per_s": round(rate["cloud_only"], 2), "hybrid_tokens_per_s": round(rate["hybrid"], 2),
            "per_prompt_ratio_geomean": round(math.exp(sum(map(math.log, per_prompt)) / len(per_prompt)), 3),
            "hybrid_rounds": rounds, "hybrid_accepted_per_round": round(accepted / max(1, rounds), 3),
            "hybrid_mean_gamma": round(spent["gamma_sum"] / max(1, rounds), 2),
            "hybrid_ms_per_round": {k: round(v * 1e3 / max(1, rounds), 2) for k, v in spent.items() if k != "gamma_sum"},
            "identical_tokens": texts["cloud_only"] == texts["hybrid"]}


def _tokenizer_dir(target: str):
    from hybridspec.common.models.pairing import describe

    return describe(target).tokenizer.directory


def main() -> None:
    parser = arguments(__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    start_ = commands.add_parser("start", help="start costs of a bare GGUF pair")
    start_.add_argument("--target", default="", help="a GGUF target (default: the embedded target's Q8_0 file)")
    start_.add_argument("--drafter", default="", help="a GGUF drafter (default: the embedded drafter, exported)")
    start_.add_argument("--no-ray", action="store_true")
    start_.add_argument("--no-edges", action="store_true", help="cloud starts only")
    start_.add_argument("--out", default="")
    memory_ = commands.add_parser("memory", help="the in-process start's resident memory, step by step")
    memory_.add_argument("--target", default="", help="a GGUF target (default: the embedded target's Q8_0 file)")
    memory_.add_argument("--out", default="")
    predict_ = commands.add_parser("predict", help="pair check's prediction against a measured run")
    predict_.add_argument("--target", default="")
    predict_.add_argument("--drafter", default="")
    predict_.add_argument("--repeats", type=int, default=2)
    predict_.add_argument("--out", default="")
    args = parser.parse_args()
    {"start": start, "memory": memory, "predict": predict}[args.command](args)


if __name__ == "__main__":
    main()
