"""An experiment's results on disk: one JSON row per generation (results.jsonl, appended as runs
finish, so an interrupted run resumes), and the CSV of the main columns written from them."""
from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

from .spec import GridPoint

CSV_FIELDS = ["strategy", "kind", "rtt_ms", "jitter_ms", "bandwidth_mbps", "loss_pct", "link", "temperature", "edges",
              "drafter", "drafter_used", "edge", "prompt_set", "prompt", "repeat", "new_tokens", "wall_s", "tokens_per_s",
              "ttft_s", "measured_rtt_ms", "step_ms_p50", "step_ms_p95", "same_as_target", "acceptance_rate",
              "mean_tokens_per_round", "rounds", "mean_gamma", "cloud_calls_per_token", "bytes_per_token",
              "uplink_bytes", "downlink_bytes", "cloud_only_tokens", "shadow_guesses", "switches_to_cloud", "pipeline_hits",
              "fallbacks"]


def read_rows(path: Path) -> list[dict]:
    """Every row of a results.jsonl (a directory means its results.jsonl)."""
    path = path / "results.jsonl" if path.is_dir() else path
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_csv(rows_file: Path, csv_file: Path) -> None:
    """The rows as CSV with the main columns (the JSONL keeps everything)."""
    rows = read_rows(rows_file)
    with csv_file.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS + ["error"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def row_key(strategy: str, point: GridPoint, prompt: int, repeat: int, edge: int) -> tuple:
    """What identifies a row, for resuming."""
    return (strategy, *dataclasses.astuple(point), prompt, repeat, edge)


def done_keys(rows_file: Path) -> set[tuple]:
    """The keys of the rows already written without an error."""
    return {tuple(r["key"]) for r in read_rows(rows_file) if "key" in r and "error" not in r}
