"""The GPU suite's quick CPU form (what CI can run of it): every part runs end to end through the real
engine, verifier core, gRPC server, relay and edge processes, and writes its three result files; with
Ray and llama-cpp-python unimportable, as on the lent GPU machine (docs/gpu.md), so a stray import of
either fails here rather than in the few minutes a GPU is lent."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ABSENT_ON_THE_GPU_MACHINE = ("ray", "llama_cpp")


def without(modules: tuple[str, ...], where: Path) -> dict[str, str]:
    """The environment with each of `modules` shadowed by a package under `where` whose import fails."""
    for name in modules:
        (where / name).mkdir(parents=True)
        (where / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed on the GPU machine')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(where), os.environ.get("PYTHONPATH")]))}


@pytest.mark.slow
def test_the_quick_cpu_suite_measures_every_part_and_finds_hybrid_exact(tmp_path):
    out = tmp_path / "suite"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--out", str(out), "--device", "cpu",
                          "--quick"], capture_output=True, text=True, timeout=600,
                         env=without(ABSENT_ON_THE_GPU_MACHINE, tmp_path / "absent"))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert results["errors"] == []
    assert results["meta"]["device"] == "cpu" and results["meta"]["commit"]
    rows = results["passes"]["tiny"]["torch"]
    assert {(r["sessions"], r["tokens"]) for r in rows} == {(1, 1), (1, 5), (8, 1), (8, 5)}
    assert all(r["ms"] > 0 for r in rows)
    assert results["engines"]["tiny"]["products"] == "torch"
    for part in results["exactness"].values():
        for kind in ("chains", "trees"):
            assert part[kind]["tokens"] > 0 and part[kind]["differing_tokens"] == 0
    assert results["capacity"]["backend"] == "process"  # the verifier in a child process, the default
    capacity = results["capacity"]["rows"]
    assert {r["mode"] for r in capacity} == {"cloud-only", "hybrid a=0.6", "hybrid a=0.8", "hybrid trace",
                                             "hybrid a=0.8, policy γ", "hybrid trace, policy γ"}
    assert {(r["rtt_ms"], r["mode"]) for r in capacity if r["rtt_ms"] == 20.0} == {(20.0, "cloud-only"),
                                                                                  (20.0, "hybrid a=0.8")}
    # Steady state: every edge committed in the window, the aggregate has an interval, the replica's
    # passes over the window were counted.
    assert all(r["errors"] == 0 and r["tokens_per_s"] > 0 and r["min_edge_tokens"] > 0 for r in capacity)
    assert all(lo <= r["tokens_per_s"] <= hi for r in capacity for lo, hi in [r["tokens_per_s_95"]])
    assert all(sum(r["iteration_tokens"]["counts"]) > 0 for r in capacity)
    assert all(0 < r["front_door_cores"] for r in capacity)
    # What the replica's hold weighed, shown beside each run: the pass model's fixed part, and how soon
    # edges came back once hybrid edges have sent rounds (cloud-only's rounds are queued by the server).
    assert results["capacity"]["hold"] == "auto"
    assert all(r["hold_inputs_ms"]["pass_fixed"] >= 0 for r in capacity)
    assert all(0 < r["hold_inputs_ms"]["return"] < 500 for r in capacity if r["mode"] != "cloud-only")
    assert all(r["p95_step_ms"] > 0 and r["p95_gap_ms"] > 0 for r in capacity)
    # Through gRPC too, hybrid commits exactly the tokens cloud-only streamed for the same prompts.
    hybrid = [r for r in capacity if r["mode"] != "cloud-only"]
    assert all(r["differing_tokens"] == 0 and r["compared_tokens"] > 0 for r in hybrid)
    assert all(r["tokens_per_round"] > 1 for r in hybrid)
    assert {r["gamma"] for r in hybrid if "policy" not in r["mode"]} == {4}
    assert results["capacity"]["trace"]["agreement"] > 0
    assert "| figure | measured | goal |" in (out / "results.md").read_text()
    assert (out / "results.png").stat().st_size > 10_000
