"""The experiment workflow end to end on CPU: experiments/smoke.yaml with tiny models, its CSV and plots."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridspec.common.config import ConfigError
from hybridspec.lab.report import observed_crossover_ms, predicted_crossover_ms
from hybridspec.lab.runner import read_rows, run_experiment
from hybridspec.lab.spec import load_spec

SMOKE = Path(__file__).resolve().parent.parent / "experiments" / "smoke.yaml"


@pytest.fixture(scope="module")
def smoke(model_dirs, tmp_path_factory):
    """experiments/smoke.yaml with the tiny models, run once through the CLI."""
    root = tmp_path_factory.mktemp("smoke")
    spec = yaml.safe_load(SMOKE.read_text())
    spec.update(target=str(model_dirs["target"]), drafter=str(model_dirs["random"]), chat=False,
                prompts=["w5 w17 w33 w80", "w9 w200 w31 w64"], pin=False)
    path = root / "smoke.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = root / "results"
    result = subprocess.run([sys.executable, "-m", "hybridspec.cli.main", "experiment", "run", str(path), "--out",
                             str(out), "--report"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return path, out


def test_every_strategy_ran_and_greedy_strategies_match_the_target(smoke):
    _, out = smoke
    rows = read_rows(out)
    assert not [r for r in rows if "error" in r]
    strategies = {s["name"] for s in yaml.safe_load(SMOKE.read_text())["strategies"]}
    assert {r["strategy"] for r in rows} == strategies
    exact = [r for r in rows if r["kind"] in ("hybrid", "colocated", "cloud_only")]
    assert exact and all(r["same_as_target"] for r in exact)
    with (out / "results.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert json.loads((out / "meta.json").read_text())["versions"]["torch"]


def test_report_writes_non_empty_plots_and_a_summary(smoke):
    _, out = smoke
    pngs = list(out.glob("*.png"))
    assert len(pngs) == 4 and all(p.stat().st_size > 5000 for p in pngs)
    assert "| cloud-only | cloud_only |" in (out / "summary.md").read_text()


def test_a_rerun_resumes_instead_of_repeating(smoke):
    path, out = smoke
    before = len(read_rows(out))
    run_experiment(load_spec(path), out)
    assert len(read_rows(out)) == before


@pytest.mark.parametrize("text, fragment", [("strategies: []", "strategies"),
                                            ("grid: {rtt: [1]}\nstrategies: [{name: a, kind: cloud_only}]", "rtt"),
                                            ("strategies: [{name: a, kind: teleport}]", "kind"),
                                            ("strategies: [{name: a, kind: hybrid, edge: {gama: 3}}]", "gama")])
def test_bad_experiment_files_name_the_problem(tmp_path, text, fragment):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        load_spec(bad)


def test_crossovers():
    fit = {"alpha": 0.8, "c": 0.0, "v": 1.0, "T": 0.05, "base_rtt_s": 0.0}
    # Free drafting, v = 1: the bound crosses 1 at RTT = T·α/(1 − α) (here with γ ≤ 8, a little earlier).
    assert predicted_crossover_ms(fit) == pytest.approx(1e3 * 0.05 * bound_gamma8_r(0.8), rel=1e-3)
    assert observed_crossover_ms({0: 1.5, 100: 0.5}) == pytest.approx(50)
    assert observed_crossover_ms({0: 0.9, 100: 0.5}) == 0.0
    assert observed_crossover_ms({0: 1.5, 100: 1.2}) is None


def bound_gamma8_r(alpha: float) -> float:
    """r where (1 − α^9)/(1 − α) / (r + 1) = 1."""
    return (1 - alpha ** 9) / (1 - alpha) - 1


def test_report_keeps_bandwidths_apart(tmp_path):
    """Regression: rows at different bandwidths were averaged together into one tokens/s per RTT."""
    import json

    from hybridspec.lab.report import report

    rows = [{"experiment": "bw", "strategy": s, "kind": k, "rtt_ms": 0, "bandwidth_mbps": bw, "temperature": 0,
             "edges": 1, "wall_s": 1.0, "tokens_per_s": tps, "cloud_calls_per_token": 0.5, "bytes_per_token": 10}
            for s, k, bw, tps in [("cloud-only", "cloud_only", 0, 20.0), ("cloud-only", "cloud_only", 1, 10.0),
                                  ("hybrid", "hybrid", 0, 30.0), ("hybrid", "hybrid", 1, 5.0)]]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report(results, tmp_path / "out")
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "unlimited bandwidth" in summary and "1 Mbit/s each way" in summary
    assert "| hybrid | 1.50 |" in summary  # 30 / 20 on the unlimited link
    assert "| hybrid | 0.50 |" in summary  # 5 / 10 at 1 Mbit/s; mixed together it would read 17.5 / 15
