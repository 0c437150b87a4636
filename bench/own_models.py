"""A user's own GGUF pair given as bare files (no tokenizer beside them): what starting a cloud and an
edge on them costs (`start`), and how well `pair check` predicts what hybrid decoding does (`predict`).

    python bench/own_models.py start [--baseline-commit 92253c5] [--drafter FILE.gguf] [--no-ray] [--out FILE]
    python bench/own_models.py predict [--target T] [--drafter D] [--repeats 2] [--out FILE]

`start`, this code against an earlier commit in one run:

The target is the embedded target's model.Q8_0.gguf linked into an empty directory; the drafter is
`--drafter`, likewise alone in a directory (default: the embedded drafter exported as a GGUF of its
own, `models export-drafter`: a GGUF drafter every version of the code can load). For each code
version (`--baseline-commit`'s files extracted with `git archive` and put first on PYTHONPATH, then
this checkout):

- `cloud serve` in-process and (unless --no-ray) with one Ray replica, a small KV pool (one stream of
  2,048 cells): seconds until it prints its serving line, and the peak resident memory of its whole
  process tree (Ray's processes included), and the CPU seconds the tree spent until then (what the
  start costs whatever else the machine runs), sampled every 50 ms with psutil; in-process once more
  with `pass_cost_tokens: 0` (no pass-cost curve measured before serving: what loading alone costs);
- `edge generate --drafter D --json` (32 new tokens), with --cloud-only twice, then with the default
  policy: the process's wall time minus the generation's own (`stats.wall_s`), its CPU seconds, and whether the
  drafter's file was ever mapped into the edge (its weights loaded: /proc/PID/maps, every 50 ms).
  This code reads a GGUF's tokenizer from its header on a file's first use and keeps it: the
  tokenizers of both files are removed from that cache first, so the in-process cloud's start and the
  first --cloud-only edge include the reading, and the later runs find it there.

Once, as the reference: llama.cpp's own load of the target (a Python process that imports llama_cpp,
loads the file and makes a context of the same size): its wall time and peak resident memory. And,
with this code only, a drafter GGUF of another vocabulary (tests/tinymodels.py `save_gguf`) given to
`pair check` and to `edge generate`: the one line each prints, and how long it took to say it.
The machine is shared: times are noisy, resident memory and "was the file opened" are not.

`predict`: `pair check`'s prediction of forced hybrid over cloud-only, against a measured run of the same pair.
1. `hybridspec pair check` (in this process, on the edge's core 0): its report, and how long it took.
2. `cloud serve` with its defaults (the Ray pool, direct verify) on core 1; on core 0 two edge workers,
   one `--cloud-only`, one forced hybrid (`--no-cloud-only-switch`, adaptive γ), both with the drafter
   on one thread (`--torch-threads 1`, as pair check measures it). Each writes pair check's prompts
   (`new_tokens` each, chat template), after one generation of warm-up; the two alternate prompt by
   prompt, `--repeats` times. Tokens/s is the generated tokens over the generation's wall time.
3. Measured: the ratio of the two modes' tokens/s, summed over all generations, and per prompt
   (geometric mean); the prediction's error against it. Greedy: both modes write the same tokens,
   which is checked. The two runs interleave so that a busy moment hits both.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import psutil

from harness import EDGE_CORE, ROOT, arguments, other_vocabulary_gguf, cloud as cloud_on_core, commit, header, pin, report, usable_cores

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


PACKAGES = ("common", "edge", "cloud", "cli", "distill", "netem", "lab", "fetch")


def baseline_path(commit: str, workdir: Path) -> Path:
    """A directory whose `hybridspec` package is `commit`'s code (put first on PYTHONPATH)."""
    src = workdir / "src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, *PACKAGES], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    package = workdir / "path" / "hybridspec"
    package.mkdir(parents=True)
    for name in PACKAGES:
        (package / name).symlink_to(src / name)
    return package.parent


def bare_copy(src: Path, into: Path) -> Path:
    """`src` alone in the empty directory `into` (a hard link where the file system allows, else a copy)."""
    into.mkdir(parents=True)
    dst = into / src.name
    try:
        os.link(src, dst)
    except OSError:
        import shutil

        shutil.copyfile(src, dst)
    return dst


class Watch:
    """A command run to its end (or to a line on stdout), its process tree sampled every 50 ms: the
    peak of the tree's summed resident memory, and whether any process of it mapped `watched`."""

    def __init__(self, cmd: list[str], env: dict, watched: Path | None = None, ready_line=None) -> None:
        self.watched = str(watched.resolve()) if watched else None
        self.peak_mib = 0.0
        self.cpu_s = 0.0  # CPU seconds (user + system) of the tree: what the work costs whatever else runs
        self.touched = False
        self.ready_s: float | None = None
        self.lines: list[str] = []
        start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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

    def _sample(self) -> None:
        try:
            root = psutil.Process(self.proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        total, cpu = 0, 0.0
        for p in tree:
            try:
                total += p.memory_info().rss
                times = p.cpu_times()
                cpu += times.user + times.system
                if self.watched and not self.touched:
                    self.touched = self._uses(p.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        self.peak_mib = max(self.peak_mib, total / 2**20)
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


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hybridspec.cli.main", *args]


def cloud(target: Path, backend: str, env: dict, **extra) -> tuple[Watch, dict]:
    """Start `cloud serve` on the bare target; (the running Watch, what its start cost)."""
    keys = {**SMALL_KV, "target": str(target), "backend": backend, **extra}
    config = Path(tempfile.mkstemp(prefix="own-models-", suffix=".json")[1])
    config.write_text(json.dumps(keys))
    w = Watch(cli("cloud", "serve", "--config", str(config)), env, ready_line=parse_ready_line)
    if w.ready_s is None:
        raise RuntimeError(f"cloud serve ({backend}) did not start: {w.stderr[-2000:]}")
    return w, {"ready_s": round(w.ready_s, 2), "cpu_s": round(w.cpu_s, 2), "peak_tree_rss_mib": round(w.peak_mib, 1),
               "peak_rss_over_file": round(w.peak_mib * 2**20 / target.stat().st_size, 2)}


def edge(address: str, drafter: Path, env: dict, *flags: str) -> dict:
    """One `edge generate --json` with the bare drafter: wall minus generation, and whether it was loaded."""
    w = Watch(cli("edge", "generate", "--cloud", address, "--drafter", str(drafter), "--prompt", PROMPT,
                  "--max-new-tokens", str(NEW_TOKENS), "--json", *flags), env, watched=drafter)
    if w.proc.returncode != 0:
        return {"error": w.stderr.strip().splitlines()[-1:] or ["exit status %d" % w.proc.returncode]}
    out = json.loads(w.lines[-1])
    gen_s = out["stats"]["wall_s"]
    return {"wall_s": round(w.wall_s, 2), "cpu_s": round(w.cpu_s, 2), "generation_s": round(gen_s, 2),
            "wall_minus_generation_s":
            round(w.wall_s - gen_s, 2), "drafter_mapped": w.touched, "peak_rss_mib": round(w.peak_mib, 1),
            "tokens": len(out["token_ids"]), "rounds": out["stats"].get("rounds", 0), "token_ids": out["token_ids"]}


def measure(target: Path, drafter: Path, ray: bool, pythonpath: str = "") -> dict:
    env = {**os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    out: dict = {}
    w, out["cloud_inprocess"] = cloud(target, "inprocess", env)
    try:
        address = parse_ready_line(next(line for line in w.lines if parse_ready_line(line)))
        out["edge_cloud_only_first"] = edge(address, drafter, env, "--cloud-only")
        out["edge_cloud_only"] = edge(address, drafter, env, "--cloud-only")
        out["edge_default"] = edge(address, drafter, env)
    finally:
        w.stop()
    w, out["cloud_inprocess_no_pass_costs"] = cloud(target, "inprocess", env, pass_cost_tokens=0)
    w.stop()
    if ray:
        w, out["cloud_ray"] = cloud(target, "ray", env)
        w.stop()
    return out


def mismatch(target: Path, work: Path) -> dict:
    """The error lines `pair check` and `edge generate` give a drafter of another vocabulary (this code)."""
    (work / "other").mkdir()
    other = other_vocabulary_gguf(work / "other" / "other.gguf")
    out = {}
    w, _ = cloud(target, "inprocess", dict(os.environ))
    try:
        address = parse_ready_line(next(line for line in w.lines if parse_ready_line(line)))
        for name, args in (("pair_check", ("pair", "check", "--target", str(target), "--drafter", str(other))),
                           ("edge_generate", ("edge", "generate", "--cloud", address, "--drafter", str(other),
                                              "--prompt", PROMPT))):
            run = Watch(cli(*args), dict(os.environ), watched=None)
            out[name] = {"exit": run.proc.returncode, "stderr": run.stderr.strip(), "wall_s": round(run.wall_s, 2),
                         "peak_rss_mib": round(run.peak_mib, 1)}
    finally:
        w.stop()
    return out


def forget_tokenizers(*files: Path) -> None:
    """Remove these files' tokenizers from the cache `gguf_file.tokenizer_files` keeps."""
    import shutil

    from hybridspec.common.models.gguf_file import TOKENIZER_FORMAT, file_identity, tokenizer_cache

    for f in files:
        shutil.rmtree(tokenizer_cache() / f"{file_identity(f)}-{TOKENIZER_FORMAT}", ignore_errors=True)


def llama_alone(target: Path) -> dict:
    """llama.cpp's own load of the target into a context of SMALL_KV's size, in a fresh process."""
    w = Watch([sys.executable, "-c", LLAMA_LOAD, str(target), str(SMALL_KV["max_context"])], dict(os.environ))
    return {"process_wall_s": round(w.wall_s, 2), "cpu_s": round(w.cpu_s, 2), "load_s": round(float(w.lines[-1]), 2),
            "peak_rss_mib": round(w.peak_mib, 1), "peak_rss_over_file": round(w.peak_mib * 2**20 / target.stat().st_size, 2)}


def start(args) -> None:
    """Start costs of a bare pair, this code and `args.baseline_commit`'s."""
    shipped = default_paths()["target"]
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        target = bare_copy(shipped / "model.Q8_0.gguf", work / "target")
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
                  "llama_cpp_alone": llama_alone(target)}
        if not args.skip_baseline:
            path = baseline_path(args.baseline_commit, work)
            result[f"baseline {args.baseline_commit}"] = measure(target, drafter, not args.no_ray, str(path))
        forget_tokenizers(target, drafter)  # this code's first start on a file reads its tokenizer: measure that
        result[f"{commit()} (this code)"] = measure(target, drafter, not args.no_ray)
        result["mismatched_vocabulary"] = mismatch(target, work)
    report(result, args.out)


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
    start_ = commands.add_parser("start", help="start costs of a bare GGUF pair, this code against an earlier commit")
    start_.add_argument("--baseline-commit", default="92253c5")
    start_.add_argument("--drafter", default="", help="a GGUF drafter (default: the embedded drafter, exported)")
    start_.add_argument("--no-ray", action="store_true")
    start_.add_argument("--skip-baseline", action="store_true")
    start_.add_argument("--out", default="")
    predict_ = commands.add_parser("predict", help="pair check's prediction against a measured run")
    predict_.add_argument("--target", default="")
    predict_.add_argument("--drafter", default="")
    predict_.add_argument("--repeats", type=int, default=2)
    predict_.add_argument("--out", default="")
    args = parser.parse_args()
    (start if args.command == "start" else predict)(args)


if __name__ == "__main__":
    main()
