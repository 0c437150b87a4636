"""What the benchmarks share, one copy of each (bench/README.md lists it); confidence intervals are
lab/stats.py's. The scripts run as `python bench/X.py`, which puts bench/ on the path: `from harness
import ...`. The tests' fixtures (tests/tinymodels.py, tests/fuzzing.py) stay out of the wheel;
`tiny_target` and `fuzz_suite` are the one way in, so no script reaches into tests/ itself.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import socket
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import date
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
EDGE_CORE, CLOUD_CORE = 0, 1  # two emulated hosts on a two-core machine (the brief's timing rule)

def usable_cores() -> list[int]:
    """The cores this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def pin(to: int | Iterable[int]) -> None:
    """Pin this process (and every thread and child it starts from now on) to core(s) `to`."""
    os.sched_setaffinity(0, {to} if isinstance(to, int) else set(to))


def pin_child(to: Iterable[int] | None) -> Callable[[], None] | None:
    """A subprocess preexec_fn pinning the child (and all it spawns) to `to`; None (no pinning) for None."""
    if not to:
        return None
    chosen = set(to)
    return lambda: os.sched_setaffinity(0, chosen)


def two_hosts() -> tuple[set[int] | None, set[int] | None]:
    """(edge cores, cloud cores): EDGE_CORE and CLOUD_CORE where this process may use both, else (None, None)."""
    cores = usable_cores()
    return ({EDGE_CORE}, {CLOUD_CORE}) if EDGE_CORE in cores and CLOUD_CORE in cores else (None, None)


def start_cloud(keys: dict | None = None, pin_edge: bool = True) -> tuple[subprocess.Popen, str]:
    """`cloud serve` with these ServeConfig keys on the cloud core (Ray and all it spawns inherit it) and,
    unless `pin_edge` is false, this process (the edges) on the edge core: (process, HOST:PORT) once serving."""
    from hybridspec.cloud.process import start_cloud_process

    edge_cores, cloud_cores = two_hosts()
    proc, address, log = start_cloud_process(keys or {}, cloud_cores)
    if pin_edge and edge_cores:
        pin(edge_cores)
    print(f"cloud serve at {address} (log {log})", file=sys.stderr, flush=True)
    return proc, address


def stop_cloud(proc: subprocess.Popen) -> None:
    """Stop a server `start_cloud` started: drained (SIGTERM), killed if it does not stop."""
    from hybridspec.cloud.process import stop_cloud_process

    stop_cloud_process(proc)


@contextlib.contextmanager
def cloud(keys: dict | None = None, pin_edge: bool = True) -> Iterator[tuple[subprocess.Popen, str]]:
    """`start_cloud` for a with block: yields (process, HOST:PORT), and leaving stops the server."""
    proc, address = start_cloud(keys, pin_edge)
    try:
        yield proc, address
    finally:
        stop_cloud(proc)


def process_tree(pid: int) -> list[psutil.Process]:
    """The psutil processes of `pid` and all its descendants (a cloud: the front door, Ray, the replicas)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def replica_processes(pid: int) -> list[psutil.Process]:
    """The replica actors among the descendants of `pid` (Ray names them ray::VerifierReplica)."""
    found = []
    for proc in process_tree(pid)[1:]:
        with contextlib.suppress(psutil.NoSuchProcess):
            if "VerifierReplica" in " ".join(proc.cmdline()):
                found.append(proc)
    return found


def rss_mb(procs: Iterable[psutil.Process]) -> float:
    """Resident memory of these processes together, in MiB (those gone meanwhile count nothing)."""
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += proc.memory_info().rss
    return total / 2**20


@contextlib.contextmanager
def frozen(procs: Iterable[psutil.Process]) -> Iterator[None]:
    """These processes stopped (SIGSTOP) for the block and continued after it; those gone are skipped."""
    stopped = []
    try:
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):  # a worker that just ended
                proc.suspend()
                stopped.append(proc)
        yield
    finally:
        for proc in reversed(stopped):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.resume()


def free_port() -> int:
    """A TCP port free on this host now (for a server's metrics endpoint)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def median(xs: Iterable[float]) -> float:
    """The median."""
    return statistics.median(xs)


def percentile(xs: Sequence[float], p: int) -> float:
    """The p-th percentile, 1 <= p <= 99 (statistics' exclusive method); one value is its own every percentile."""
    if not 1 <= p <= 99:
        raise ValueError(f"percentile {p} is outside 1..99")
    if len(xs) == 1:
        return float(xs[0])
    return statistics.quantiles(xs, n=100)[p - 1]


def pass_times(engine, context: Sequence[int], tokens: Sequence[int], repeats: int) -> list[float]:
    """Milliseconds of `repeats` scored passes of `tokens` after `context` cached tokens, each cut back
    (cloud/core/costs.py's `time_pass`, as a replica measures its own curve)."""
    from hybridspec.cloud.core.costs import time_pass
    from hybridspec.cloud.engine.base import Feed

    kv = engine.new_sequence()
    try:
        engine.reserve(kv, len(context))
        engine.forward([Feed(kv, list(context), scored=False)])
        return [time_pass(engine, kv, len(context), tokens)[0] for _ in range(repeats)]
    finally:
        engine.release(kv)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" where it has none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def commit() -> str:
    """The checkout's short commit, "+dirty" when tracked files differ (HYBRIDSPEC_COMMIT where set), or "unknown"."""
    if os.environ.get("HYBRIDSPEC_COMMIT"):
        return os.environ["HYBRIDSPEC_COMMIT"]
    run = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if not run.stdout.strip():
        return "unknown"
    dirty = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "."]).returncode != 0
    return run.stdout.strip() + ("+dirty" if dirty else "")


def header(**fields: Any) -> dict[str, Any]:
    """The fields every result file starts with: date, commit and cpu, then `fields` (engine, weights, ...)."""
    return {"date": date.today().isoformat(), "commit": commit(), "cpu": cpu_model(), **fields}


def write_json(path: str | Path, result: Any, indent: int = 1) -> str:
    """Write `result` as JSON (with a final newline) to `path`, its folder made where missing; returns the text."""
    text = json.dumps(result, indent=indent)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text + "\n")
    return text


def report(result: Any, out: str | Path | None = None, indent: int = 1) -> None:
    """Print `result` as JSON and, where `out` is given, write it there too (the scripts' last step)."""
    print(json.dumps(result, indent=indent), flush=True)
    if out:
        write_json(out, result, indent)


def write_results(out: Path, result: Any, markdown: str, indent: int = 1) -> None:
    """`out`/results.json and `out`/results.md (the tables, also printed): a report of several tables."""
    write_json(out / "results.json", result, indent)
    (out / "results.md").write_text(markdown)
    print(markdown)


def arguments(doc: str | None) -> argparse.ArgumentParser:
    """The script's argument parser, described by its docstring's first paragraph."""
    return argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])


def tests_module(name: str):
    """A module of tests/ (run from a checkout: the wheel does not ship the tests' fixtures)."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.append(str(ROOT / "tests"))
    return importlib.import_module(name)


def tiny_target(out: Path, seed: int = 0, name: str = "target") -> str:
    """A random 2-layer Llama with a real tokenizer (tests/tinymodels.py) saved in `out/name`: seed 0 is the
    tests' target, another seed a model that rarely agrees with it."""
    tiny = tests_module("tinymodels")
    return str(tiny.save_model(tiny.make_model(seed=seed), out / name))


def fuzz_suite():
    """(Fuzzer, calls) of tests/fuzzing.py: the hostile messages tests/test_fuzz.py sends too."""
    fuzzing = tests_module("fuzzing")
    return fuzzing.Fuzzer, fuzzing.calls


# Okabe–Ito colours with a marker and a line style each: series stay apart in grey print too.
STYLES = ({"color": "#0072B2", "marker": "o", "linestyle": "-"},
          {"color": "#D55E00", "marker": "s", "linestyle": "--"},
          {"color": "#009E73", "marker": "^", "linestyle": "-."},
          {"color": "#CC79A7", "marker": "D", "linestyle": ":"},
          {"color": "#E69F00", "marker": "v", "linestyle": (0, (5, 1))},
          {"color": "#56B4E9", "marker": "P", "linestyle": (0, (3, 1, 1, 1))})
REFERENCE = {"color": "grey", "linewidth": 1}  # goal and reference lines


def style(i: int, markers: bool = True) -> dict[str, Any]:
    """Plot keywords of series `i` (without its marker for `markers=False`: long time series)."""
    s = dict(STYLES[i % len(STYLES)])
    if not markers:
        s.pop("marker")
    return s


def series(ax, i: int, x, y, err=None, label: str | None = None, markers: bool = True) -> None:
    """Series `i` in its own style; with `err` (half-widths, same units as y) as capped error bars."""
    if err is None:
        ax.plot(x, y, label=label, **style(i, markers))
    else:
        ax.errorbar(x, y, yerr=err, capsize=4, label=label, **style(i, markers))


def figure(ncols: int = 1, figsize: tuple[float, float] = (6, 4)):
    """(figure, axes) with the headless backend; axes is one Axes for ncols=1, else a tuple."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=figsize)
    return fig, axes if ncols == 1 else tuple(axes)


def save_figure(fig, path: str | Path) -> None:
    """Light grid on every axis, tight layout, 120 dpi, and the figure closed."""
    import matplotlib.pyplot as plt

    for ax in fig.axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
