"""A user's own GGUF pair given as bare files (no tokenizer beside them): what starting a cloud and an
edge on them costs, this code against an earlier commit, in one run.

    python bench/own_models.py [--baseline-commit 92253c5] [--drafter FILE.gguf] [--no-ray] [--out FILE]

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
with this code only, a drafter GGUF of another vocabulary (lab/tinymodels.py `save_gguf`) given to
`pair check` and to `edge generate`: the one line each prints, and how long it took to say it.
The machine is shared: times are noisy, resident memory and "was the file opened" are not.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import psutil

from harness import arguments, commit, header, report
from replica_memory import baseline_path

from hybridspec.cloud.process import parse_ready_line
from hybridspec.common.models.embedded import default_paths

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
    from hybridspec.lab.tinymodels import save_gguf

    (work / "other").mkdir()
    other = save_gguf(work / "other" / "other.gguf")
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


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--baseline-commit", default="92253c5")
    parser.add_argument("--drafter", default="", help="a GGUF drafter (default: the embedded drafter, exported)")
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
