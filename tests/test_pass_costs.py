"""The cloud measures what a pass of M tokens costs and reports it (GetModelInfo); the edge's policy
sizes blocks by that curve plus what it measures on top."""
import json
import math

import pytest

from hybridspec.cloud.api.server import BackgroundServer
from hybridspec.cloud.core.costs import cost_sizes, measure_batch_costs, measure_pass_costs
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.cloud.engine.torch_engine import engine_for
from hybridspec.common.protocol import codec
from hybridspec.common.protocol.proto import verifier_pb2 as pb
from hybridspec.common.protocol.wire import ModelInfo
from hybridspec.edge import policy
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.estimates import Estimates
from hybridspec.edge.worker import EdgeWorker


def test_sizes_cover_every_small_block_and_end_at_the_largest():
    assert cost_sizes(0) == ()
    assert cost_sizes(1) == (1,)
    assert cost_sizes(5) == (1, 2, 3, 4, 5)
    sizes = cost_sizes(33)
    assert sizes[:8] == tuple(range(1, 9)) and sizes[-1] == 33 and list(sizes) == sorted(set(sizes))


def test_measuring_leaves_the_engine_as_it_was(target):
    engine = engine_for(target.model, 1024)
    points = measure_pass_costs(engine, target.vocab_size, 9, repeats=2)
    assert [m for m, _ in points] == list(cost_sizes(9))
    assert all(ms > 0 and math.isfinite(ms) for _, ms in points)
    assert engine.fill() == 0.0  # every page back in the pool


def test_get_model_info_reports_the_measured_curve_over_grpc(target):
    verifier = Verifier(target, VerifierLimits(max_context=512, max_draft=6, max_tree_nodes=0))
    verifier.measure_pass_costs(32)  # capped at a whole round: max_draft + 1 tokens (no trees here)
    server = BackgroundServer(verifier)
    try:
        with VerifierClient(server.address) as client:
            info = client.model_info()
    finally:
        server.stop()
    assert [m for m, _ in info.pass_costs] == [1, 2, 3, 4, 5, 6, 7]
    assert all(ms > 0 for _, ms in info.pass_costs)


def test_a_server_with_trees_measures_up_to_its_largest_tree(target):
    verifier = Verifier(target, VerifierLimits(max_context=512, max_draft=6, max_tree_nodes=11))
    verifier.measure_pass_costs(32)  # a round of a tree: its 11 nodes and the root
    assert verifier.info.pass_costs[-1][0] == 12


def test_a_worker_takes_the_clouds_curve(target, model_dirs):
    verifier = Verifier(target, VerifierLimits(max_context=512, max_draft=6))
    verifier.measure_pass_costs(7)
    server = BackgroundServer(verifier)
    try:
        with VerifierClient(server.address) as client:
            worker = EdgeWorker(target, client, EdgeConfig.of(cloud=server.address, max_draft=6))
            curve = worker.estimates.rates(policy.Rates([0.5], 0, 0, 0, 0, 0, 0.01)).verify_curve_s
    finally:
        server.stop()
    reported = dict(verifier.info.pass_costs)
    assert curve[0] == pytest.approx(reported[1] / 1e3) and curve[4] == pytest.approx(reported[5] / 1e3)


@pytest.mark.parametrize("points", [
    [(2, 1.0), (1, 2.0)],  # M not increasing
    [(1, 1.0), (1, 2.0)],  # M repeated
    [(0, 1.0)],  # no pass of 0 tokens
    [(1, -1.0)],  # negative time
    [(1, float("nan"))],
    [(1, float("inf"))],
])
def test_an_edge_ignores_a_broken_curve(points):
    wire = pb.ModelInfo(pass_costs=[pb.PassCost(tokens=m, ms=ms) for m, ms in points])
    assert codec.model_info_from_pb(wire).pass_costs == ()


def test_a_sane_curve_survives_the_wire():
    wire = pb.ModelInfo(pass_costs=[pb.PassCost(tokens=1, ms=6.5), pb.PassCost(tokens=4, ms=30.25)])
    assert codec.model_info_from_pb(wire).pass_costs == ((1, 6.5), (4, 30.25))


def test_interpolation_is_piecewise_linear_and_extends_the_last_segment():
    points = [(1, 10.0), (2, 20.0), (4, 30.0)]
    assert policy.interpolate(points, 1) == 10.0
    assert policy.interpolate(points, 3) == 25.0
    assert policy.interpolate(points, 6) == 40.0
    assert policy.interpolate(points, 0) == 0.0
    assert policy.interpolate([(1, 7.0)], 5) == 7.0


def test_the_curve_sets_the_shape_and_rounds_set_the_level():
    est = Estimates(8)
    est.use_pass_costs(((1, 10.0), (5, 50.0)))  # ms: cost linear in tokens, as one CPU's Q4 kernels
    defaults = policy.Rates([0.5], 0.001, 0.0, 0.01, 0.01, 0.0, 0.01)
    assert est.rates(defaults).verify_s(4) == pytest.approx(0.050)
    for _ in range(200):
        est.observe_verify(4, 0.053)  # every round costs 3 ms more than the bare pass
    rates = est.rates(defaults)
    assert rates.verify_s(4) == pytest.approx(0.053, abs=1e-4)
    assert rates.verify_s(0) == pytest.approx(0.013, abs=1e-4)  # the same residual on every size


def test_a_steep_curve_keeps_the_edge_cloud_only_a_flat_one_lets_it_draft():
    """What the llama.cpp engine measured here: t(5) ≈ 5·t(1) on Q4_1, so even a drafter right 90 % of
    the time cannot pay; with a GPU-like flat curve the same drafter pays well."""
    def judged(points_ms):
        est = Estimates(8, prior_alpha=0.9, prior_weight=100)
        est.use_pass_costs(points_ms)
        est.cloud_token_s.add(points_ms[0][1] / 1e3)
        est.draft_s.add(0.001)
        return est.rates(policy.Rates([0.5], 0, 0, 0, 0, 0, 0))

    steep = judged(tuple((m, 7.0 * m) for m in range(1, 10)))
    flat = judged(tuple((m, 7.0 + 0.1 * m) for m in range(1, 10)))
    assert policy.prefer_cloud_only(steep, 8, pipelined=True, now_cloud_only=True)
    assert not policy.prefer_cloud_only(flat, 8, pipelined=True, now_cloud_only=True)
    assert policy.best_speedup(flat, 8, pipelined=True) > 2


def test_passes_of_several_sessions_are_measured_per_batch_size_and_leave_the_engine_as_it_was(target):
    engine = engine_for(target.model, 4096)
    free = engine.pool.free_pages
    points = measure_batch_costs(engine, target.vocab_size, 3, sessions=(4, 2, 64), repeats=1)
    # 64 sessions × (128 + 3) tokens do not fit 4,096: that size is left out, not half measured.
    assert [(b, m) for b, m, _ in points] == [(2, 1), (2, 2), (2, 3), (4, 1), (4, 2), (4, 3)]
    assert all(ms > 0 for _, _, ms in points)
    assert engine.pool.free_pages == free


def test_batch_costs_travel_in_model_info_and_a_bad_group_is_dropped():
    info = ModelInfo("t", 100, "", "", 512, 8, 8, 600, pass_costs=((1, 5.0), (5, 5.5)),
                     batch_pass_costs=((8, 1, 6.0), (8, 5, 7.0), (64, 1, 10.5), (64, 5, 23.75)))  # float32 on the wire: exact halves
    assert codec.model_info_from_pb(codec.model_info_to_pb(info)) == info
    old_server = pb.ModelInfo(pass_costs=[pb.PassCost(tokens=1, ms=5.0)])
    assert codec.model_info_from_pb(old_server).batch_pass_costs == ()
    bad = pb.ModelInfo(batch_pass_costs=[pb.PassCost(sessions=8, tokens=5, ms=7.0), pb.PassCost(sessions=8, tokens=1, ms=6.0)])
    assert codec.model_info_from_pb(bad).batch_pass_costs == ()  # M must increase within a group
    one = pb.ModelInfo(batch_pass_costs=[pb.PassCost(sessions=1, tokens=1, ms=6.0)])
    assert codec.model_info_from_pb(one).batch_pass_costs == ()  # one session's curve is pass_costs


def test_a_loaded_gpu_replica_prices_gamma_by_the_batch_curve_it_measured():
    """The 8B shape on an H100 (docs/engine/gpu/h100-2026-11-27-main.md): alone, t(5) = t(1); at 64
    sessions t(64 × 5) = 2.3 t(64 × 1). An edge whose streamed tokens take t(64 × 1) is among ~64."""
    est = Estimates(8)
    est.use_pass_costs(((1, 7.95), (5, 8.17)), ((8, 1, 8.06), (8, 5, 8.59), (64, 1, 10.45), (64, 5, 23.89)))
    est.cloud_token_s.add(0.01045)
    defaults = policy.Rates([0.5], 0.001, 0.0, 0.01, 0.01, 0.0, 0.01)
    assert est.rates(defaults).verify_s(4) == pytest.approx(0.02389, rel=1e-3)
    assert est.verify.batch_like(1.0) is None and est.verify.batch_like(1.01) == 8
    alone = Estimates(8)
    alone.use_pass_costs(((1, 7.95), (5, 8.17)))  # no batch curve: the one-session curve scaled by load
    alone.cloud_token_s.add(0.01045)
    assert alone.rates(defaults).verify_s(4) == pytest.approx(0.00817 * 10.45 / 7.95, rel=1e-3)


# ---- a replica serves before its curve: kept on disk, else measured while it serves ------------

def replica_spec(model_dirs, max_context: int = 512) -> "ReplicaSpec":
    from hybridspec.cloud.pool.specs import ReplicaSettings, ReplicaSpec

    return ReplicaSpec(str(model_dirs["target"]), ReplicaSettings(device="cpu", torch_threads=1, pass_cost_tokens=9),
                       VerifierLimits(max_context=max_context, max_draft=8, max_tree_nodes=0, max_sessions=4))


def serve_until_measured(spec) -> tuple[tuple, list]:
    """load_verifier, then serve it in-process until its curve is in; (the curve GetModelInfo gave
    while loading had ended, the infos `measured` got)."""
    import threading

    from hybridspec.cloud.pool.loading import load_verifier

    measured, ready = [], threading.Event()
    verifier = load_verifier(spec, lambda info: (measured.append(info), ready.set()))
    at_load = verifier.info.pass_costs
    server = BackgroundServer(verifier)
    try:
        assert ready.wait(60)
        with VerifierClient(server.address) as client:
            reported = client.model_info().pass_costs  # float32 on the wire
            assert [m for m, _ in reported] == [m for m, _ in measured[0].pass_costs]
            assert [ms for _, ms in reported] == pytest.approx([ms for _, ms in measured[0].pass_costs], rel=1e-6)
    finally:
        server.stop()
    return at_load, measured


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty $HYBRIDSPEC_HOME for the curve cache (the pulled models are not needed here)."""
    monkeypatch.setenv("HYBRIDSPEC_HOME", str(tmp_path))
    return tmp_path / "pass-costs"


def test_a_replica_serves_before_its_curve_then_reports_and_keeps_it(model_dirs, home):
    at_load, measured = serve_until_measured(replica_spec(model_dirs))
    assert at_load == ()  # the start did not wait for the curve
    assert len(measured) == 1 and [m for m, _ in measured[0].pass_costs] == list(cost_sizes(9))
    kept = json.loads(next(home.glob("*.json")).read_text())
    assert [tuple(p) for p in kept["pass_costs"]] == list(measured[0].pass_costs)
    assert kept["key"]["model"] == measured[0].model_fingerprint and kept["key"]["settings"]["threads"] == 1


def test_a_kept_curve_is_used_and_another_key_measures_again(model_dirs, home):
    from hybridspec.cloud.pool.loading import load_verifier

    serve_until_measured(replica_spec(model_dirs))
    (path,) = home.glob("*.json")
    kept = json.loads(path.read_text())
    kept["pass_costs"] = [[m, 100.0 + m] for m, _ in kept["pass_costs"]]  # no machine measures this
    path.write_text(json.dumps(kept))
    calls = []
    verifier = load_verifier(replica_spec(model_dirs), calls.append)
    assert verifier.info.pass_costs == tuple((m, 100.0 + m) for m in cost_sizes(9))
    assert [info.pass_costs for info in calls] == [verifier.info.pass_costs]  # at once, not measured
    # Another max_context is another KV layout: its curve is measured afresh and kept beside.
    at_load, measured = serve_until_measured(replica_spec(model_dirs, max_context=256))
    assert at_load == () and measured[0].pass_costs[0][1] < 100.0
    assert len(list(home.glob("*.json"))) == 2


@pytest.mark.parametrize("garbage", ["{not json", '{"key": 1}', "[]", ""])
def test_a_corrupt_kept_curve_is_ignored_with_a_log_line_and_replaced(model_dirs, home, caplog, garbage):
    serve_until_measured(replica_spec(model_dirs))
    (path,) = home.glob("*.json")
    valid = json.loads(path.read_text())
    path.write_text(garbage)
    with caplog.at_level("WARNING", logger="hybridspec.cloud.core.cost_cache"):
        at_load, measured = serve_until_measured(replica_spec(model_dirs))
    assert at_load == () and measured
    assert any(path.name in r.getMessage() for r in caplog.records), caplog.text
    assert json.loads(path.read_text())["key"] == valid["key"]  # measured again, and kept again


def test_a_cache_that_cannot_be_written_is_logged_and_the_replica_serves(model_dirs, tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache's directory would go")
    monkeypatch.setenv("HYBRIDSPEC_HOME", str(blocked))
    with caplog.at_level("WARNING", logger="hybridspec.cloud.core.cost_cache"):
        _, measured = serve_until_measured(replica_spec(model_dirs))
    assert measured[0].pass_costs and "could not keep the pass-cost curve" in caplog.text


def test_the_curve_is_measured_a_pass_at_a_time_while_no_session_is_open(target, monkeypatch):
    """An open that arrives while the curve is measured waits for one pass of it; while a session is
    open the measurement gives its context back and waits; once none is, it goes on to the end."""
    import time

    from hybridspec.cloud.core import costs
    from hybridspec.common.protocol.wire import SessionSpec

    monkeypatch.setattr(costs, "RETRY_S", 0.01)
    verifier = Verifier(target, VerifierLimits(max_context=512, max_draft=8, max_tree_nodes=0))
    measurement = verifier.pass_cost_measurement(9)
    costs.measure_in_background(measurement, verifier.submit_call,
                                lambda m: verifier.publish_pass_costs(*m.curves), verifier.idle)
    opened = verifier.open_session(SessionSpec(session_id="s", committed_ids=(5, 17, 33)))
    assert opened.committed_len == 3
    for _ in range(40):  # each blocking call steps once: a piece would run in each (28 in all), were it idle
        verifier.stats()
        time.sleep(0.02)
    held = verifier.engine.fill() * verifier.engine.capacity_tokens
    assert not measurement.done and verifier.info.pass_costs == () and held < costs.CONTEXT_TOKENS
    verifier.close_session("s")
    deadline = time.monotonic() + 60
    while not measurement.done and time.monotonic() < deadline:
        verifier.stats()
        time.sleep(0.02)
    assert [m for m, _ in verifier.info.pass_costs] == list(cost_sizes(9))
    assert verifier.engine.fill() == 0.0  # the context went back too


def test_a_full_cache_puts_the_measurement_off_instead_of_evicting(target):
    from hybridspec.cloud.core.costs import CONTEXT_TOKENS, CurveMeasurement

    engine = engine_for(target.model, 256)
    held = engine.new_sequence()
    engine.reserve(held, 256 - CONTEXT_TOKENS)  # a session's cache leaves no room for the measurement's context
    measurement = CurveMeasurement(engine, target.vocab_size, 9, repeats=1)
    fill = engine.fill()
    assert measurement.piece() is False and engine.fill() == fill and not measurement.done
    engine.release(held)
    while not measurement.done:
        assert measurement.piece()
    assert [m for m, _ in measurement.curves[0]] == list(cost_sizes(9))


def test_an_edge_that_connected_before_the_curve_takes_it_once_there(target, model_dirs, monkeypatch):
    import time

    from hybridspec.edge import worker as worker_module

    monkeypatch.setattr(worker_module, "CURVE_ASK_S", 0.0)
    verifier = Verifier(target, VerifierLimits(max_context=512, max_draft=6, max_tree_nodes=0))
    server = BackgroundServer(verifier)
    try:
        with VerifierClient(server.address) as client:
            worker = EdgeWorker(target, client, EdgeConfig.of(cloud=server.address, max_draft=6, max_new_tokens=4))
            assert worker.estimates.verify.pass_costs == ()  # the no-curve path: its own rounds (edge/estimates.py)
            worker.generate([5, 17, 33])
            curve = ((1, 4.0), (7, 10.0))
            verifier.publish_pass_costs(curve)
            worker.generate([5, 17, 33])  # its start asks again, off the generation's path
            deadline = time.monotonic() + 30
            while worker.estimates.verify.pass_costs == () and time.monotonic() < deadline:
                time.sleep(0.05)
            assert worker.estimates.verify.pass_costs == ((1, 0.004), (7, 0.010))
            assert worker.info.pass_costs == curve
    finally:
        server.stop()
