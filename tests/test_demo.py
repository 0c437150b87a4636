"""`hybridspec demo` end to end on the real embedded pair: warm-up, turns, the interval it prints."""
import json
import subprocess
import sys

import pytest

from conftest import require_embedded


@pytest.mark.embedded
@pytest.mark.slow
def test_the_demo_times_both_strategies_in_turns_and_prints_an_interval(tmp_path):
    require_embedded()
    saved = tmp_path / "demo.json"
    done = subprocess.run([sys.executable, "-m", "hybridspec.cli.main", "demo", "--turns", "2", "--max-new-tokens",
                           "24", "--save", str(saved)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(saved.read_text())
    assert record["turns"] == 2 and record["same_tokens"]
    assert len(record["default_edge_tokens_per_s"]) == len(record["cloud_only_tokens_per_s"]) == 2
    s = record["speedup"]
    ratios = [h / c for h, c in zip(record["default_edge_tokens_per_s"], record["cloud_only_tokens_per_s"])]
    assert s["mean"] == pytest.approx(sum(ratios) / 2) and s["lo"] <= s["mean"] <= s["hi"]
    out = " ".join(done.stdout.split())  # rich wraps lines at the terminal's width
    assert "measured over 2 turns" in out and f"[{s['lo']:.2f}, {s['hi']:.2f}]" in out
    assert "same tokens as cloud-only, every turn" in out


def test_turns_must_be_a_positive_whole_number():
    done = subprocess.run([sys.executable, "-m", "hybridspec.cli.main", "demo", "--turns", "0"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--turns" in done.stderr and "whole number >= 1" in done.stderr
