"""bench/harness.py holds what the benchmarks share (pinning, pass timing, medians and percentiles, the
result file's header and JSON, plots), and the scripts use it instead of writing their own; confidence
intervals are lab/stats.py's alone; every script still starts and answers --help (the commands the docs
quote), and bench/README.md documents each one."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from hybridspec.cloud.engine.torch_engine import engine_for
from test_layers import CHECKED, PROGRAMS

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if '\nif __name__ == "__main__":' in p.read_text())

# What only the harness may write: a second copy is a second way to compute the same number.
REIMPLEMENTED = {
    "pinning": re.compile(r"sched_setaffinity|sched_getaffinity|\btaskset\b[^\n]*subprocess|\[\"taskset\""),
    "percentiles": re.compile(r"statistics\.quantiles|np\.percentile|numpy\.percentile|np\.quantile|statistics\.median"),
    "plot setup": re.compile(r"import matplotlib|plt\.subplots"),
    "commit": re.compile(r"rev-parse"),
    "cpu model": re.compile(r"/proc/cpuinfo"),
    "pass timing": re.compile(r"perf_counter\(\)\n\s*[\w.]*forward\(\[Feed"),
    "reaching into tests/": re.compile(r"sys\.path|def tiny_target|from (tinymodels|fuzzing) import|tests_module"),
}


def load_harness():
    spec = importlib.util.spec_from_file_location("bench_harness", BENCH / "harness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


harness = load_harness()


# What only lab/stats.py may compute (the harness included): one confidence interval for every number.
INTERVALS = re.compile(r"stats\.t\.(ppf|interval)|statistics\.stdev|def t_interval|t_quantile\(")


def test_no_bench_script_reimplements_what_the_harness_holds():
    found = {f"{p.name}: {what}" for p in BENCH.glob("*.py") if p.name != "harness.py"
             for what, pattern in REIMPLEMENTED.items() if pattern.search(p.read_text())}
    found |= {f"{p.name}: intervals" for p in BENCH.glob("*.py") if INTERVALS.search(p.read_text())}
    assert not found, sorted(found)


def test_the_scan_finds_a_reimplementation():
    """The patterns above catch the code they were written against (so the scan can fail)."""
    old = ('os.sched_setaffinity(0, {1})\nq = statistics.quantiles(xs, n=10)\n'
           't0 = time.perf_counter()\n        engine.forward([Feed(kv, context[:m], scored=True)])\n')
    assert {w for w, p in REIMPLEMENTED.items() if p.search(old)} == {"pinning", "percentiles", "pass timing"}
    assert INTERVALS.search("half = stats.t.ppf(0.975, n - 1) * statistics.stdev(xs)")


HELP_DRIVER = """
import contextlib, io, json, runpy, sys
failed = {}
for script in sys.argv[1:]:
    sys.argv, out = [script, "--help"], io.StringIO()
    sys.path.insert(0, str(__import__("pathlib").Path(script).parent))
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
        failed[script] = "no exit after --help"
    except SystemExit as exc:
        if exc.code not in (0, None) or "usage:" not in out.getvalue():
            failed[script] = f"exit {exc.code}: {out.getvalue()[-200:]}"
    except Exception as exc:
        failed[script] = repr(exc)[-400:]
    finally:
        sys.path.pop(0)
print(json.dumps(failed))
"""


@pytest.mark.slow
def test_every_bench_script_answers_help():
    """Each script's imports resolve and its --help prints usage: all in one interpreter, so torch and
    the package are imported once, not once per script."""
    assert len(SCRIPTS) >= 5 and BENCH / "gpu_suite.py" in SCRIPTS
    run = subprocess.run([sys.executable, "-c", HELP_DRIVER, *map(str, SCRIPTS)], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    failed = json.loads(run.stdout.strip().splitlines()[-1])
    assert not failed, failed


# A script named as `COMMIT:bench/X.py` is one in git history (tests/test_docs.py checks the commit has it).
MENTIONED = re.compile(r"(?<![\w:])bench/(\w+)\.py")
COMMAND = re.compile(r"python bench/(\w+)\.py(?:[ \t]+([a-z][\w-]*))?")


def pages() -> list[Path]:
    """README, the docs' pages (with the figures' registry), bench/README.md and the tests: where bench
    commands are quoted. Result files in docs/'s subfolders record the command of their own commit."""
    return [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "docs" / "figures.yaml",
            BENCH / "README.md", *(ROOT / "tests").glob("*.py")]


def test_every_bench_command_the_docs_quote_names_a_script_and_its_subcommand():
    """A renamed or merged script takes its quotes with it: each bench script named exists and, where
    it has subcommands, the word after the quoted command is one of them (tests/test_docs.py checks the
    figures themselves)."""
    texts = [page.read_text() for page in pages()]
    wrong = sorted({f"bench/{name}.py: no such script" for text in texts for name in MENTIONED.findall(text)
                    if not (BENCH / f"{name}.py").is_file()})
    for name, word in sorted({m.groups() for text in texts for m in COMMAND.finditer(text)}, key=str):
        script = BENCH / f"{name}.py"
        subcommands = set(re.findall(r'add_parser\("([\w-]+)"', script.read_text())) if script.is_file() else set()
        if subcommands and word not in subcommands:
            wrong.append(f"python bench/{name}.py {word or ''}: not one of its subcommands {sorted(subcommands)}")
    assert not wrong, wrong


def test_every_bench_script_has_its_row_in_the_one_table():
    """bench/README.md documents each benchmark in one table (what it measures, how long, what it writes)."""
    table = [line for line in (BENCH / "README.md").read_text().splitlines() if line.startswith("| `")]
    named = {name for line in table for name in re.findall(r"bench/(\w+)\.py", line.split(" | ")[0])}
    assert named == {p.stem for p in SCRIPTS if p.name != "harness.py"}, named
    assert all(line.count(" | ") == 4 and "—" not in line.split(" | ")[2] for line in table)


def test_the_tests_fixtures_stay_out_of_the_wheel():
    """The tiny models and the fuzz strategies are the tests' fixtures (tests/tinymodels.py,
    tests/fuzzing.py): no shipped module imports them, or hypothesis (a test dependency); in bench/ the
    harness alone reaches into tests/ (`tiny_target`, `fuzz_suite`: REIMPLEMENTED holds the scripts to it)."""
    shipped = [p for folder in (*CHECKED, *PROGRAMS) for p in (ROOT / folder).rglob("*.py")]
    found = [str(p.relative_to(ROOT)) for p in shipped
             if re.search(r"^\s*(from|import) (tinymodels|fuzzing|hypothesis)\b", p.read_text(), re.M)]
    assert shipped and not found, found
    assert [p.name for p in BENCH.glob("*.py") if '"tests"' in p.read_text()] == ["harness.py"]


@pytest.mark.parametrize("p, n", [(90, 10), (95, 20), (50, 2)])
def test_percentiles_are_statistics_cut_points(p, n):
    xs = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0, 3.5, 8.9, 7.9, 3.2]
    assert harness.percentile(xs, p) == pytest.approx(statistics.quantiles(xs, n=n)[n * p // 100 - 1])
    assert harness.percentile([2.5], p) == 2.5
    assert harness.median(xs) == statistics.median(xs)


@pytest.mark.parametrize("p", [0, 100])
def test_a_percentile_outside_1_to_99_is_refused(p):
    with pytest.raises(ValueError, match="outside"):
        harness.percentile([1.0, 2.0], p)


def test_pinning_reaches_children():
    core = harness.usable_cores()[-1]
    show = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    child = subprocess.run(show, capture_output=True, text=True, preexec_fn=harness.pin_child({core}), check=True)
    assert child.stdout.strip() == f"[{core}]"
    assert harness.pin_child(None) is None
    pinned = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(BENCH)!r}); import harness; "
                             f"harness.pin({core}); import os; print(sorted(os.sched_getaffinity(0)))"],
                            capture_output=True, text=True, check=True)
    assert pinned.stdout.strip() == f"[{core}]"


def test_the_header_names_date_commit_and_cpu_and_the_json_reads_back(tmp_path, monkeypatch):
    monkeypatch.delenv("HYBRIDSPEC_COMMIT", raising=False)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    result = {**harness.header(engine="llamacpp, 1 thread", weights="Q8_0"), "rows": [1.5]}
    assert list(result)[:5] == ["date", "commit", "cpu", "engine", "weights"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", result["date"]) and result["cpu"]
    assert result["commit"].removesuffix("+dirty") == (head.stdout.strip() or "unknown")
    monkeypatch.setenv("HYBRIDSPEC_COMMIT", "abc1234")
    assert harness.commit() == "abc1234"
    text = harness.write_json(tmp_path / "r.json", result)
    assert (tmp_path / "r.json").read_text() == text + "\n" and json.loads(text) == result


def test_pass_times_time_scored_passes_and_give_the_cache_back(target):
    engine = engine_for(target.model, 1024)
    times = harness.pass_times(engine, list(range(10, 60)), [7, 8, 9], repeats=3)
    assert len(times) == 3 and all(t > 0 and math.isfinite(t) for t in times)
    assert engine.fill() == 0.0


def test_plots_keep_series_apart_and_save(tmp_path):
    assert len({(s["color"], s["marker"], str(s["linestyle"])) for s in harness.STYLES}) == len(harness.STYLES)
    assert "marker" not in harness.style(0, markers=False)
    fig, (left, right) = harness.figure(2, figsize=(8, 3))
    harness.series(left, 0, [1, 2, 3], [1.0, 2.0, 1.5], err=[0.1, 0.2, 0.1], label="with 95 % interval")
    harness.series(right, 1, [1, 2, 3], [3.0, 2.0, 1.0], label="plain")
    harness.save_figure(fig, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 5_000
    assert [line.get_marker() for line in left.lines + right.lines][-1] == "s"  # series 1's own marker


def test_report_prints_the_result_and_writes_it_where_asked(tmp_path, capsys):
    harness.report({"a": [1, 2]}, None)
    assert json.loads(capsys.readouterr().out) == {"a": [1, 2]}
    harness.report({"b": 3}, tmp_path / "deeper" / "r.json", indent=2)
    assert json.loads(capsys.readouterr().out) == {"b": 3} == json.loads((tmp_path / "deeper" / "r.json").read_text())


def test_the_parser_is_described_by_the_docstrings_first_paragraph():
    parser = harness.arguments("What it measures,\nover two lines.\n\n    python bench/SCRIPT [--n 3]\n")
    assert parser.description == "What it measures,\nover two lines."
    assert harness.arguments(None).description == ""


def test_two_hosts_split_the_edge_and_cloud_cores_and_pin_nothing_on_one_core():
    """harness.cloud pins `cloud serve` to two_hosts()'s cloud cores and the caller to its edge cores."""
    cores = harness.usable_cores()
    expected = ({harness.EDGE_CORE}, {harness.CLOUD_CORE}) if {harness.EDGE_CORE, harness.CLOUD_CORE} <= set(cores) \
        else (None, None)
    assert harness.two_hosts() == expected
    show = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(BENCH)!r}); import harness; "
            "print(harness.two_hosts())"]
    alone = subprocess.run(show, capture_output=True, text=True, check=True, preexec_fn=harness.pin_child({cores[0]}))
    assert alone.stdout.strip() == "(None, None)"


@pytest.mark.slow
def test_own_models_start_leaves_the_users_kept_curves_and_tokenizers_alone(tmp_path):
    """`own_models.py start` measures a first start (no curve kept, the tokenizer not yet read) under a
    cache home of its own: a user's kept pass-cost curve and tokenizer of the same file stay, and nothing of
    the run lands in the user's home. (It used to delete them, and a later `make demo` measured anew.)"""
    from tinymodels import save_gguf

    from hybridspec.common.models.gguf_file import TOKENIZER_FORMAT, file_identity

    model = save_gguf(tmp_path / "tiny.gguf")
    home = tmp_path / "home"
    kept = {home / "pass-costs" / "kept.json": json.dumps({"key": {"model": file_identity(model)}, "curves": []}),
            home / "gguf-tokenizers" / f"{file_identity(model)}-{TOKENIZER_FORMAT}" / "tokenizer.json": "{}"}
    for path, text in kept.items():
        path.parent.mkdir(parents=True)
        path.write_text(text)
    run = subprocess.run([sys.executable, str(BENCH / "own_models.py"), "start", "--target", str(model), "--drafter",
                          str(model), "--no-ray", "--no-edges"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HYBRIDSPEC_HOME": str(home)}, cwd=BENCH)
    assert run.returncode == 0, run.stderr[-2000:]
    starts = next(value for key, value in json.loads(run.stdout).items() if key.endswith("(this code)"))
    assert starts["cloud_inprocess"]["curve_s"] is not None  # the first start measured a curve of its own
    assert all(path.read_text() == text for path, text in kept.items())
    assert sorted(p for p in home.rglob("*") if p.is_file()) == sorted(kept)
