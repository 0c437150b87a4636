"""bench/round_path.py counts the files and frames on a steady-state verify round's path (issue 41):
it must find both sides of the round and leave out what happens once per generation."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_counter_finds_edge_and_cloud_and_counts_only_steady_rounds(tmp_path):
    out = tmp_path / "path.json"
    run = subprocess.run([sys.executable, "bench/round_path.py", "--tokens", "26", "--gamma", "4", "--out", str(out)],
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
    assert "cloud/core/scheduler.py -> cloud/core/verifier.py" in result["path_by_side"]["cloud"]["handoffs"]
    # ... and opens, closes and builds nothing: that is setup and teardown.
    once = ("Generation._begin_open", "OpenSession", "CloseSession", "Generation._build_drafter", "Generation.__init__")
    assert not [name for name in calls if name.endswith(once)]
