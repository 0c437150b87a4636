"""scripts/round_path.py counts the files and frames on a steady-state verify round's path: it must find
both sides of the round and leave out what happens once per generation, on the tiny torch target
through the front door and on the embedded target on llama.cpp with direct verify."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_embedded

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_counter_finds_edge_and_cloud_and_counts_only_steady_rounds(tmp_path):
    out = tmp_path / "path.json"
    run = subprocess.run([sys.executable, "scripts/round_path.py", "--tokens", "26", "--gamma", "4", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result == json.loads(run.stdout)
    # 26 tokens in rounds of 4 accepted drafts + the verifier's token: 5 full rounds and a last one;
    # the first and the last are not counted.
    assert result["rounds"] == 6 and result["rounds_counted"] == 4
    edge, cloud = result["by_side"]["edge"], result["by_side"]["cloud"]
    assert {"edge/generation.py", "edge/client.py", "common/protocol/codec.py"} <= set(edge["files"])
    assert {"cloud/api/service.py", "cloud/core/verifier.py", "common/protocol/codec.py"} <= set(cloud["files"])
    assert not any(f.startswith("cloud/") for f in edge["files"]) and not any(f.startswith("edge/") for f in cloud["files"])
    assert edge["frames_per_round"] > 10 and cloud["frames_per_round"] > 10
    assert result["frames_per_round"] == sum(side["frames_per_round"] for side in result["by_side"].values())
    assert result["files"] == len(set(edge["files"]) | set(cloud["files"]))
    # Every steady round sends a block and commits a verdict, once ...
    calls = {**result["calls_per_round"]["cloud"], **result["calls_per_round"]["edge"]}
    assert calls["edge/generation.py:Generation.hybrid_round"] == 1 == calls["cloud/core/verifier.py:Verifier.step"]
    # ... derives what a block is once in the cloud: its shape (chain or tree) and its session id's check ...
    cloud_calls = result["calls_per_round"]["cloud"]
    assert cloud_calls.get("common/protocol/wire.py:DraftBlock.is_tree", 0) <= 1
    assert cloud_calls["common/protocol/wire.py:check_session_id"] == 1
    # The reading path: files that hand the round on, apart from those only looked up.
    assert result["path_files"] == len(result["path"]) and not set(result["path"]) & set(result["looked_up"])
    assert set(result["path"]) | set(result["looked_up"]) >= set(edge["files"]) | set(cloud["files"])
    assert {"edge/generation.py", "cloud/api/service.py", "cloud/core/verifier.py"} <= set(result["path"])
    assert "common/protocol/wire.py" in result["looked_up"]  # dataclasses: called, calling nothing of ours
    # On the edge the generation hands the round to the client itself, nothing in between.
    edge_handoffs = result["path_by_side"]["edge"]["handoffs"]
    assert [h for h in edge_handoffs if h.endswith("-> edge/client.py")] == ["edge/generation.py -> edge/client.py"]
    # The cloud's spine: the servicer hands the round to the pool, the pool to its replica (the
    # verifier itself, in-process), whose step hands it to the engine; nothing forwards in between.
    cloud_path = result["path_by_side"]["cloud"]
    assert {"cloud/api/service.py -> cloud/pool/pool.py", "cloud/pool/pool.py -> cloud/core/verifier.py",
            "cloud/core/verifier.py -> cloud/engine/torch_engine.py"} <= set(cloud_path["handoffs"])
    between = {f for f in cloud_path["files"] if f.startswith(("cloud/pool/", "cloud/core/"))}
    assert between <= {"cloud/pool/pool.py", "cloud/core/verifier.py", "cloud/core/rules.py"}, between
    # The spine: the edge hands the round to the wire, the cloud's servicer through the pool (in
    # process, through the front door) to the step and the engine.
    assert result["spine"] == sorted(["edge/generation.py", "edge/client.py", "common/protocol/codec.py",
                                      "cloud/api/service.py", "cloud/pool/pool.py", "cloud/core/verifier.py",
                                      "cloud/engine/torch_engine.py"])
    assert result["spine_files"] == len(result["spine"]) and set(result["spine"]) <= set(result["path"])
    # ... and opens, closes and builds nothing: that is setup and teardown.
    once = ("Generation._begin_open", "OpenSession", "CloseSession", "Generation._build_drafter", "Generation.__init__")
    assert not [name for name in calls if name.endswith(once)]


@pytest.mark.embedded
@pytest.mark.slow
def test_on_the_default_deployment_the_servicer_hands_the_round_straight_to_the_step(tmp_path):
    """The embedded target on llama.cpp, rounds sent to the verifier's own endpoint (direct verify): the
    cloud's spine is the servicer, the verifier's step and the engine, with no pool in between."""
    require_embedded()
    out = tmp_path / "path.json"
    run = subprocess.run([sys.executable, "scripts/round_path.py", "--engine", "llamacpp", "--tokens", "26", "--out",
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    cloud = json.loads(out.read_text())["path_by_side"]["cloud"]
    assert {"cloud/api/service.py -> cloud/core/verifier.py",
            "cloud/core/verifier.py -> cloud/engine/llamacpp_engine.py"} <= set(cloud["handoffs"])
    assert "cloud/api/service.py -> cloud/pool/pool.py" not in cloud["handoffs"]
    # The spine a reader follows, both sides: the generation, the client, the codec, the servicer, the
    # step and the engine.
    assert json.loads(out.read_text())["spine"] == sorted([
        "edge/generation.py", "edge/client.py", "common/protocol/codec.py", "cloud/api/service.py",
        "cloud/core/verifier.py", "cloud/engine/llamacpp_engine.py"])
