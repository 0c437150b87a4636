"""The experiment workflow end to end on CPU: experiments/smoke.yaml with tiny models, its CSV, plots and
summary; the report's statistics on planted data."""
import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridspec.common.config import ConfigError
from hybridspec.lab import aggregate
from hybridspec.lab.report import predicted_crossover_ms
from hybridspec.lab.rows import read_rows
from hybridspec.lab.runner import run_experiment
from hybridspec.lab.spec import load_spec
from hybridspec.lab.stats import crossing, mean_ci, t_quantile
from tinymodels import greedy_reference

SMOKE = Path(__file__).resolve().parent.parent / "experiments" / "smoke.yaml"


@pytest.fixture(scope="module")
def smoke(model_dirs, tmp_path_factory):
    """experiments/smoke.yaml with the tiny models, run once through the CLI."""
    root = tmp_path_factory.mktemp("smoke")
    spec = yaml.safe_load(SMOKE.read_text())
    spec.update(target=str(model_dirs["target"]), drafter=str(model_dirs["random"]), chat=False,
                prompts={"templated": ["w5 w17 w33 w80", "w9 w200 w31 w64"], "freeform": ["w3 w3 w3", "w100 w7"]},
                pin=False)
    spec["vary"]["drafter"] = [str(model_dirs["target"])]  # a second drafter: the target itself
    path = root / "smoke.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = root / "results"
    result = subprocess.run([sys.executable, "-m", "hybridspec.cli.main", "experiment", "run", str(path), "--out",
                             str(out), "--report"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return path, out


@pytest.mark.slow
def test_every_strategy_ran_and_greedy_rows_match_the_independent_reference(smoke, target):
    _, out = smoke
    rows = read_rows(out)
    assert not [r for r in rows if "error" in r]
    strategies = {s["name"] for s in yaml.safe_load(SMOKE.read_text())["strategies"]}
    assert {r["strategy"] for r in rows} == strategies
    # the reference is the target's own decoding, computed once per prompt, not a row of the sweep
    references = json.loads((out / "references.json").read_text())
    prompts = references["prompts"]
    assert [references["tokens"][str(i)] for i in range(len(prompts))] == \
        [greedy_reference(target, p, 16)[:len(references["tokens"][str(i)])] for i, p in enumerate(prompts)]
    exact = [r for r in rows if r["kind"] in ("hybrid", "colocated", "cloud_only") and r["temperature"] == 0]
    assert exact and all(r["same_as_target"] is True for r in exact)
    assert all(r.get("same_as_target") is None for r in rows if r["temperature"] > 0)
    with (out / "results.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert json.loads((out / "meta.json").read_text())["versions"]["torch"]


@pytest.mark.slow
def test_rows_carry_what_the_edge_measured_and_one_trace_per_strategy_and_point(smoke):
    _, out = smoke
    linked = [r for r in read_rows(out) if r["kind"] in ("hybrid", "cloud_only")]
    assert all(r["ttft_s"] > 0 and r["measured_rtt_ms"] > 0 for r in linked)  # filled in (that they
    # crossed the link: test_hybrid_rounds_cross_the_emulated_link_with_a_ray_pool)
    assert any(r.get("step_ms_p50") for r in linked)
    assert all(r["step_ms_p95"] >= r["step_ms_p50"] for r in linked if r.get("step_ms_p50"))
    traces = list((out / "traces").glob("*.jsonl"))
    assert traces and all(json.loads(t.read_text().splitlines()[0]).keys() == {"t_s", "token", "origin"}
                          for t in traces)


@pytest.mark.slow
def test_strategies_take_turns_on_each_prompt_over_the_link(smoke):
    """Over a link, every strategy runs a prompt before any runs the next one, so drift between
    strategies cannot pose as a speed-up; the order rotates, so none always goes first."""
    _, out = smoke
    linked = [r for r in read_rows(out) if r["kind"] in ("hybrid", "cloud_only")]
    strategies = {r["strategy"] for r in linked}
    assert len(strategies) >= 2
    rows = [r for r in linked if r["key"][1:-3] == linked[0]["key"][1:-3]]  # one grid point, in file order
    turns = [(r["repeat"], r["key"][-3]) for r in rows]  # (repeat, first prompt of the group)
    assert turns == sorted(turns)
    groups = {t: [r["strategy"] for r in rows if (r["repeat"], r["key"][-3]) == t] for t in turns}
    assert all(set(names) == strategies for names in groups.values())
    assert len({names[0] for names in groups.values()}) > 1


@pytest.mark.slow
def test_smoke_varies_every_dimension_and_the_report_gives_each_value_its_panel(smoke):
    _, out = smoke
    rows = aggregate.ok_rows(read_rows(out))
    panels = aggregate.facets(rows)
    for key in aggregate.FACET_KEYS:
        seen = {dict(p.values).get(key) for p in panels}
        assert len(seen) >= 2, f"{key}: the report shows only {seen}"
    # no panel pools two values of any condition
    for panel in panels:
        linked = [r for r in panel.rows if r.get("rtt_ms") is not None]
        for key in aggregate.FACET_KEYS:
            assert len({r.get(key) for r in linked}) == 1, (panel.title, key)
    summary = (out / "summary.md").read_text()
    assert summary.count("\n## ") == len(panels)


@pytest.mark.slow
def test_report_writes_non_empty_plots_and_a_summary(smoke):
    _, out = smoke
    pngs = {p.name: p for p in out.glob("*.png")}
    assert set(pngs) == {"tokens_per_s_vs_rtt.png", "speedup_vs_rtt.png", "acceptance_per_position.png",
                         "cloud_calls_and_bytes_per_token.png", "capacity_vs_edges.png"}
    assert all(p.stat().st_size > 5000 for p in pngs.values())
    summary = (out / "summary.md").read_text()
    assert "| cloud-only | cloud_only |" in summary and "Greedy exactness" in summary


@pytest.mark.slow
def test_a_cloud_only_row_is_never_its_own_reference(smoke, model_dirs):
    """Regression: the first greedy cloud-only row became the reference, so it always matched itself."""
    from hybridspec.lab.runner import Lab
    from hybridspec.lab.spec import GridPoint, Strategy

    path, out = smoke
    lab = Lab(load_spec(path), out)
    lab._load_references()  # read back from references.json, not recomputed
    reference = lab.references[0]
    point = GridPoint(rtt_ms=0, jitter_ms=0, bandwidth_mbps=0, loss_pct=0, link="", temperature=0, edges=1, drafter="")
    wrong = [t + 1 for t in reference]
    row = lab._row(point, Strategy("cloud-only", "cloud_only"), {"tokens": wrong, "wall_s": 1.0, "edge": 0, "prompt": 0}, 0)
    assert row["same_as_target"] is False
    assert lab.references[0] == reference  # and the row did not become the reference either


@pytest.mark.slow
def test_a_rerun_resumes_instead_of_repeating(smoke):
    path, out = smoke
    before = len(read_rows(out))
    run_experiment(load_spec(path), out)
    assert len(read_rows(out)) == before


@pytest.mark.parametrize("text, fragment", [("strategies: []", "strategies"),
                                            ("grid: {rtt: [1]}\nstrategies: [{name: a, kind: cloud_only}]", "rtt"),
                                            ("strategies: [{name: a, kind: teleport}]", "kind"),
                                            ("strategies: [{name: a, kind: hybrid, edge: {gama: 3}}]", "gama"),
                                            ("grid: {link: [moon]}\nstrategies: [{name: a, kind: cloud_only}]", "moon"),
                                            ("grid: {link: ['trace:/no/such.csv']}\nstrategies: [{name: a, kind: cloud_only}]",
                                             "/no/such.csv"),
                                            ("netem_backend: kernel\nstrategies: [{name: a, kind: cloud_only}]",
                                             "netem_backend")])
def test_bad_experiment_files_name_the_problem(tmp_path, text, fragment):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        load_spec(bad)


@pytest.mark.parametrize("path", sorted(SMOKE.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_experiment_file_loads(path):
    spec = load_spec(path)
    assert spec.points() and spec.prompt_texts()


def test_a_trace_link_replays_the_file_with_the_points_bandwidth(tmp_path):
    from hybridspec.lab.spec import link_spec

    trace = tmp_path / "drive.txt"
    trace.write_text("0,80\n1,30\n")
    path = tmp_path / "t.yaml"
    path.write_text(f"grid: {{link: ['trace:{trace}', lte], bandwidth_mbps: [2]}}\n"
                    "strategies: [{name: a, kind: cloud_only}]")
    replayed, preset = load_spec(path).points()
    spec = link_spec(replayed)
    assert spec.up == spec.down and spec.up.trace.rtt_ms == (80.0, 30.0) and spec.up.bandwidth_mbps == 2
    assert link_spec(preset).up.trace is None and link_spec(preset).down.bandwidth_mbps == 21.0  # lte: its own


def test_crossovers():
    fit = {"alpha": 0.8, "c": 0.0, "v": 1.0, "T": 0.05, "base_rtt_s": 0.0}
    # Free drafting, v = 1: the bound crosses 1 at RTT = T·α/(1 − α) (here with γ ≤ 8, a little earlier).
    assert predicted_crossover_ms(fit) == pytest.approx(1e3 * 0.05 * bound_gamma8_r(0.8), rel=1e-3)
    assert crossing({0: 1.5, 100: 0.5}.items()) == pytest.approx(50)
    assert crossing({0: 0.9, 100: 0.5}.items()) == 0
    assert crossing({0: 1.5, 100: 1.2}.items()) is None


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 11, 30, 200])
def test_student_t_quantiles_match_scipy(df):
    """lab/stats.py has no scipy (the demo uses it in any install); its t quantiles are scipy's."""
    from scipy import stats

    for p in (0.5, 0.9, 0.975, 0.995):
        assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9, abs=1e-12)
    values = [0.93, 1.02, 0.99, 1.05, 0.97]
    est = mean_ci(values)
    half = stats.t.ppf(0.975, 4) * statistics.stdev(values) / len(values) ** 0.5
    assert (est.lo, est.hi) == pytest.approx((statistics.fmean(values) - half, statistics.fmean(values) + half))


def bound_gamma8_r(alpha: float) -> float:
    """r where (1 − α^9)/(1 − α) / (r + 1) = 1."""
    return (1 - alpha ** 9) / (1 - alpha) - 1


def _rows(spec: list[tuple], prompts: int = 16, repeats: int = 3, seed: int = 0) -> list[dict]:
    """Synthetic rows: (strategy, kind, bandwidth, rtt, tokens/s) cells, each over prompts × repeats
    with prompt-to-prompt spread and noise."""
    import random

    rng = random.Random(seed)
    prompt_effect = [rng.gauss(0, 2.0) for _ in range(prompts)]
    rows = []
    for strategy, kind, bw, rtt, tps in spec:
        for p in range(prompts):
            for rep in range(repeats):
                value = tps + prompt_effect[p] + rng.gauss(0, 1.0)
                rows.append({"experiment": "planted", "strategy": strategy, "kind": kind, "rtt_ms": rtt,
                             "bandwidth_mbps": bw, "jitter_ms": 0, "loss_pct": 0, "link": "", "temperature": 0,
                             "edges": 1, "drafter": "", "prompt_set": "", "prompt": p, "repeat": rep, "wall_s": 1.0,
                             "new_tokens": 16, "tokens_per_s": value, "cloud_calls_per_token": 0.5,
                             "bytes_per_token": 10})
    return rows


def test_a_planted_difference_is_found_and_no_difference_is_not():
    rows = _rows([("a", "hybrid", 0, 0, 20.0), ("b", "hybrid", 0, 0, 21.5), ("c", "hybrid", 0, 0, 20.0)])
    found = aggregate.paired_difference(rows, "b", "a")
    assert found.excludes(0) and found.lo > 0 and found.value == pytest.approx(1.5, abs=0.6)
    assert not aggregate.paired_difference(rows, "c", "a").excludes(0)


def test_speedup_and_crossover_carry_intervals():
    cells = [("cloud-only", "cloud_only", 0, rtt, 20.0) for rtt in (0, 50, 100, 150)] + \
            [("hybrid", "hybrid", 0, rtt, 20.0 * s) for rtt, s in ((0, 1.6), (50, 1.3), (100, 0.9), (150, 0.6))]
    (panel,) = aggregate.facets(_rows(cells))
    speed = aggregate.speedups(panel)["hybrid"]
    assert speed[0].lo > 1 > speed[150].hi
    cross = aggregate.crossover(panel, "hybrid")
    assert cross.verdict == "crosses" and cross.estimate.lo < 87.5 < cross.estimate.hi
    assert cross.estimate.lo > 50 and cross.estimate.hi < 100


def test_the_worst_prompt_is_found_by_its_own_speed_up():
    rows = _rows([("cloud-only", "cloud_only", 0, 20, 20.0), ("hybrid", "hybrid", 0, 20, 20.0)], prompts=4)
    for r in rows:
        if r["strategy"] == "hybrid" and r["prompt"] == 2:
            r["tokens_per_s"] *= 0.5  # one prompt at half speed: hidden in the mean, not in the worst
    (panel,) = aggregate.facets(rows)
    prompt, ratio = aggregate.worst_prompts(panel, "hybrid")[20]
    cloud, hybrid = ([statistics.fmean(r["tokens_per_s"] for r in rows if r["strategy"] == s and r["prompt"] == 2)
                      for s in ("cloud-only", "hybrid")])
    assert prompt == 2 and ratio.value == pytest.approx(hybrid / cloud) and ratio.value < 0.6
    assert ratio.lo <= ratio.value <= ratio.hi


def test_the_worst_prompts_interval_resamples_its_repeats_in_pairs():
    """A prompt whose strategies ran side by side keeps their pairing: with the same machine drift in both
    runs of every repeat the ratio is exact and the interval has no width; noise in one widens it."""
    rows = []
    for repeat, drift in enumerate((1.0, 0.7, 1.2, 0.9)):
        for strategy, kind, speed in (("cloud-only", "cloud_only", 30.0), ("hybrid", "hybrid", 27.0)):
            rows.append({"strategy": strategy, "kind": kind, "rtt_ms": 0, "prompt": 0, "repeat": repeat,
                         "tokens_per_s": speed * drift, "temperature": 0, "edges": 1})
    (panel,) = aggregate.facets(rows)
    _, paired = aggregate.worst_prompts(panel, "hybrid")[0]
    assert paired.value == pytest.approx(0.9) and paired.hi - paired.lo == pytest.approx(0, abs=1e-12)
    rows[1]["tokens_per_s"] *= 0.8  # one hybrid run slower than its pair
    (panel,) = aggregate.facets(rows)
    _, noisy = aggregate.worst_prompts(panel, "hybrid")[0]
    assert noisy.lo < noisy.value < 0.9 and noisy.hi > noisy.value


@pytest.mark.slow
def test_report_keeps_bandwidths_apart(tmp_path):
    """Regression: rows at different bandwidths were averaged together into one tokens/s per RTT."""
    from hybridspec.lab.report import report

    rows = _rows([("cloud-only", "cloud_only", 0, 0, 20.0), ("cloud-only", "cloud_only", 1, 0, 10.0),
                  ("hybrid", "hybrid", 0, 0, 30.0), ("hybrid", "hybrid", 1, 0, 5.0)], prompts=4, repeats=1)
    for r in rows:  # no noise: exact ratios
        r["tokens_per_s"] = {("cloud-only", 0): 20.0, ("cloud-only", 1): 10.0, ("hybrid", 0): 30.0,
                             ("hybrid", 1): 5.0}[r["strategy"], r["bandwidth_mbps"]]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report(results, tmp_path / "out")
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "## Mbit/s unlimited" in summary and "## Mbit/s 1" in summary
    assert "| hybrid | 1.50 [1.50, 1.50] |" in summary  # 30 / 20 on the unlimited link
    assert "| hybrid | 0.50 [0.50, 0.50] |" in summary  # 5 / 10 at 1 Mbit/s; pooled it would read 17.5 / 15


@pytest.mark.slow
def test_hybrid_rounds_cross_the_emulated_link_with_a_ray_pool(model_dirs, tmp_path, monkeypatch):
    """Regression: with the Ray pool's direct verify on (its default), an edge streamed its rounds to
    the replica's own port and bypassed the emulated link: rows at RTT 60 ms measured about 2 ms. Every
    channel an edge opens, hybrid or cloud-only, must go to a link the runner started."""
    from hybridspec.edge import client as client_module
    from hybridspec.lab import runner

    dialled, links = [], []
    endpoint = client_module._Endpoint.__init__

    def recording_endpoint(self, address, *args, **kwargs):
        dialled.append(address)
        endpoint(self, address, *args, **kwargs)

    class RecordedLink(runner.BackgroundLink):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            links.append(self.address)

    monkeypatch.setattr(client_module._Endpoint, "__init__", recording_endpoint)
    monkeypatch.setattr(runner, "BackgroundLink", RecordedLink)
    spec = {"target": str(model_dirs["target"]), "drafter": str(model_dirs["target"]), "chat": False,
            "prompts": ["w5 w17 w33 w80"], "max_new_tokens": 12, "repeats": 1, "pin": False,
            "cloud": {"replica_num_cpus": 0.5}, "grid": {"rtt_ms": [60]},
            "strategies": [{"name": "fixed-g4", "kind": "hybrid",
                            "edge": {"gamma_policy": "fixed", "max_draft": 4, "fallback_threshold": 0.0,
                                     "cloud_only_switch": False, "pipeline": False}},
                           {"name": "cloud-only", "kind": "cloud_only"}]}
    path = tmp_path / "linked.yaml"
    path.write_text(yaml.safe_dump(spec))
    rows = read_rows(run_experiment(load_spec(path), tmp_path / "out"))
    assert len(rows) == 2 and not [r.get("error") for r in rows if "error" in r]
    assert all(r["same_as_target"] is True for r in rows)
    assert dialled and set(dialled) <= set(links), (dialled, links)  # none to a replica's own port


@pytest.mark.slow
def test_edges_can_run_as_processes_of_their_own(model_dirs, tmp_path):
    """edge_processes: each concurrent edge slot is a process (N devices), kept across strategies and
    prompts; its rows are as exact as a thread's."""
    import os

    spec = {"target": str(model_dirs["target"]), "drafter": str(model_dirs["target"]), "chat": False,
            "prompts": ["w5 w17 w33 w80", "w9 w200 w31 w64"], "max_new_tokens": 8, "repeats": 1, "pin": False,
            "cloud": {"backend": "inprocess"}, "grid": {"rtt_ms": [0], "edges": [2]}, "edge_processes": True,
            "strategies": [{"name": "cloud-only", "kind": "cloud_only"}, {"name": "hybrid", "kind": "hybrid"}]}
    path = tmp_path / "processes.yaml"
    path.write_text(yaml.safe_dump(spec))
    rows = read_rows(run_experiment(load_spec(path), tmp_path / "out"))
    assert len(rows) == 4 and not [r for r in rows if "error" in r]
    assert all(r["same_as_target"] is True for r in rows)
    pids = {r["edge"]: r["edge_pid"] for r in rows if r["strategy"] == "hybrid"}
    assert len(set(pids.values())) == 2 and os.getpid() not in pids.values()
    assert all(r["edge_pid"] == pids[r["edge"]] for r in rows)  # one process per slot, for every strategy


@pytest.mark.parametrize("value", ["yes", 1])
def test_a_switch_that_is_not_true_or_false_is_refused(tmp_path, value):
    path = tmp_path / "switch.yaml"
    path.write_text(yaml.safe_dump({"edge_processes": value, "strategies": [{"name": "a", "kind": "cloud_only"}]}))
    with pytest.raises(ConfigError, match="edge_processes must be true or false"):
        load_spec(path)


def test_direct_verify_in_an_experiment_is_refused(tmp_path):
    path = tmp_path / "direct.yaml"
    path.write_text("cloud: {direct_verify: true}\nstrategies: [{name: a, kind: cloud_only}]\n")
    with pytest.raises(ConfigError, match="direct_verify.*bypass"):
        load_spec(path)


@pytest.mark.slow
def test_the_cloud_and_every_prompt_are_warm_before_the_first_timed_generation_and_orders_rotate(
        model_dirs, tmp_path, monkeypatch):
    """Regression: the first generation after the cloud started paid its one-time costs (the first
    generation of each never_slower run of 2026-11-27 waited 260-320 ms longer for its first token than
    the cloud-only one beside it), a prompt's first run paid the prefill its second then found cached,
    and with an even number of prompts every prompt ran its strategies in the same order in every
    repeat: all of it fell on the same strategy each time."""
    from hybridspec.lab import runner

    calls: list[tuple[str, tuple[int, ...], int]] = []
    generate = runner.Slot.generate

    def recording(self, strategy, prompt, repeat, trace):
        calls.append((strategy, tuple(prompt), repeat))
        return generate(self, strategy, prompt, repeat, trace)

    monkeypatch.setattr(runner.Slot, "generate", recording)
    spec = {"target": str(model_dirs["target"]), "drafter": str(model_dirs["target"]), "chat": False,
            "prompts": ["w5 w17 w33 w80", "w9 w200 w31 w64"], "max_new_tokens": 6, "repeats": 2, "pin": False,
            "cloud": {"backend": "inprocess"}, "grid": {"rtt_ms": [0, 20]},
            "strategies": [{"name": "cloud-only", "kind": "cloud_only"}, {"name": "hybrid", "kind": "hybrid"}]}
    path = tmp_path / "warm.yaml"
    path.write_text(yaml.safe_dump(spec))
    rows = read_rows(run_experiment(load_spec(path), tmp_path / "out"))
    assert len(rows) == 16 and not [r for r in rows if "error" in r]
    warm, timed = calls[:3], calls[3:]
    assert len(timed) == len(rows)  # warmed once per run, not per grid point
    assert sorted(c[0] for c in warm[:2]) == ["cloud-only", "hybrid"] and warm[0][1] == warm[1][1]
    assert {c[1] for c in warm} == {c[1] for c in timed}  # every prompt ran once, untimed
    firsts: dict[tuple, set[str]] = {}
    for point in range(2):
        runs = timed[8 * point:8 * point + 8]  # 2 prompts x 2 repeats x 2 strategies
        for (a, prompt, _), (b, *_) in zip(runs[::2], runs[1::2]):
            assert a != b  # a prompt's runs of the two strategies are adjacent
            firsts.setdefault((point, prompt), set()).add(a)
    assert all(len(first) == 2 for first in firsts.values()), firsts  # each went first in one of the repeats
