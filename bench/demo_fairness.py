"""Is `hybridspec demo`'s comparison of the default edge with cloud-only fair, and if not, why?

    python bench/demo_fairness.py [--sessions 5] [--pairs 6] [--out FILE.json]

Each session is a fresh demo: a new `cloud serve` (one Ray replica) on core 1, a new edge worker on
core 0 (one thread), the demo's prompt, settings and 96 tokens. It first replays the demo as it was
before issue 43 (a 32-token warm-up of the default edge, then the default edge, then cloud-only,
once each) and then runs the strategies below taking turns, the order rotating, `pairs` times each:

  default     the default edge (decodes cloud-only here, shadow drafting while hybrid could win)
  cloud-only  the baseline (`--cloud-only`: nothing drafted or measured)
  no-shadow   the default edge with probe_tokens 0: cloud-only without shadow drafting or decisions
  shadow      the default edge made to shadow-draft every token (as it does where hybrid could win,
              e.g. on a machine whose replica verifies a block more cheaply): what shadowing costs

    python bench/demo_fairness.py --pool docs/experiments/demo_fairness/run_*.json   (pools saved runs)

Per generation it records tokens/s, the time to the first token, the gaps between tokens and how
many shadow guesses it made; the summary gives each session's replayed demo ratio and, over the
turns, each strategy's speed against cloud-only with a 95 % interval and the order effect. Prints
one JSON object (and writes it to --out).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hybridspec.cli.demo_cmd import DEFAULT_PROMPT, DEMO_TEXT, WARMUP_TOKENS
from hybridspec.cli.edge_cmd import prompt_ids
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.controller import Controller
from hybridspec.edge.generation import EventKind
from hybridspec.lab.stats import mean_ci
from harness import (CLOUD_CORE, EDGE_CORE, arguments, commit, cpu_model, pin, start_cloud, stop_cloud, usable_cores,
                     write_json)

NEW_TOKENS = 96
STRATEGIES = ("default", "cloud-only", "no-shadow", "shadow")


def strategy_config(config: EdgeConfig, name: str) -> EdgeConfig:
    """The demo's config as `name` runs it."""
    if name == "cloud-only":
        return config.updated(cloud_only=True)
    if name == "no-shadow":
        return config.updated(probe_tokens=0)
    return config


@contextmanager
def shadowing(on: bool):
    """While on, the controller believes hybrid could win, so a cloud-only stream shadow-drafts every
    token (its decisions still follow the measured rates, which keep it cloud-only here)."""
    original = Controller.hybrid_could_win
    if on:
        Controller.hybrid_could_win = lambda self: True
    try:
        yield
    finally:
        Controller.hybrid_could_win = original


def timed(worker, prompt: list[int], config: EdgeConfig, shadow: bool = False) -> dict:
    """One generation: tokens/s as the demo computes it, TTFT, gaps and shadow guesses."""
    with shadowing(shadow):
        return _timed(worker, prompt, config)


def _timed(worker, prompt: list[int], config: EdgeConfig) -> dict:
    checks_before = worker.estimates.checked[0]
    start = time.perf_counter()
    stamps: list[float] = []
    gen = worker.stream(prompt, config)
    for event in gen:
        if event.kind is EventKind.COMMIT and event.tokens:
            stamps.extend([time.perf_counter()] * len(event.tokens))
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"tokens_per_s": gen.stats.tokens_per_s, "wall_s": gen.stats.wall_s, "new_tokens": gen.stats.new_tokens,
            "ttft_s": stamps[0] - start if stamps else None, "rounds": gen.stats.rounds,
            "cloud_only_tokens": gen.stats.cloud_only_tokens, "shadow_checks": worker.estimates.checked[0] - checks_before,
            "gap_ms_mean": 1e3 * statistics.fmean(gaps) if gaps else None,
            "gap_ms_max": 1e3 * max(gaps) if gaps else None, "token_ids": gen.token_ids}


def session(index: int, pairs: int, strategies: tuple[str, ...]) -> dict:
    """One fresh demo's worth of generations."""
    from hybridspec.cli.edge_options import build_worker

    pin((EDGE_CORE, CLOUD_CORE))
    server, address = start_cloud({"torch_threads": 1})  # and this process on the edge core
    try:
        import torch

        torch.set_num_threads(1)
        config = EdgeConfig.of(cloud=address, max_new_tokens=NEW_TOKENS, torch_threads=1, **DEMO_TEXT)
        worker = build_worker(config)
        prompt = prompt_ids(worker.codec, DEFAULT_PROMPT, chat=True)
        # 1. The demo as it was: warm-up, default edge, cloud-only, once each; every other session with
        #    the two timed generations swapped, to tell the order's share from the strategy's.
        worker.generate(prompt, config.updated(max_new_tokens=WARMUP_TOKENS))
        swapped = index % 2 == 1
        if swapped:
            old_cloud = timed(worker, prompt, strategy_config(config, "cloud-only"))
            old_default = timed(worker, prompt, config)
        else:
            old_default = timed(worker, prompt, config)
            old_cloud = timed(worker, prompt, strategy_config(config, "cloud-only"))
        # 2. Turns, the order rotating: each strategy leads as often as it follows.
        rows = []
        for turn in range(pairs * len(strategies)):
            k = turn % len(strategies)
            order = strategies[k:] + strategies[:k]
            for position, name in enumerate(order):
                row = timed(worker, prompt, strategy_config(config, name), shadow=name == "shadow")
                rows.append({"session": index, "turn": turn, "position": position, "strategy": name, **row})
        worker.close()
    finally:
        stop_cloud(server)
        pin((EDGE_CORE, CLOUD_CORE))
    first, second = (old_cloud, old_default) if swapped else (old_default, old_cloud)
    return {"session": index, "old_demo": {"default": old_default, "cloud-only": old_cloud, "first": "cloud-only"
                                           if swapped else "default",
                                           "ratio": old_default["tokens_per_s"] / old_cloud["tokens_per_s"],
                                           "first_vs_second": first["tokens_per_s"] / second["tokens_per_s"]},
            "turns": rows}


def summarise(sessions: list[dict], strategies: tuple[str, ...]) -> dict:
    """Old-demo ratios, and per strategy its ratio to the cloud-only run of the same turn."""
    rows = [r for s in sessions for r in s["turns"]]
    ratios = turn_ratios(sessions)
    out = {"old_demo_ratios": [round(s["old_demo"]["ratio"], 3) for s in sessions],
           "old_demo_first": [s["old_demo"]["first"] for s in sessions],
           "old_demo_first_vs_second": [round(s["old_demo"]["first_vs_second"], 3) for s in sessions],
           "same_tokens": all(len({tuple(r["token_ids"]) for r in rows if r["session"] == s["session"]}) == 1
                              for s in sessions)}
    for name, values in ratios.items():
        est = mean_ci(values)
        out[f"{name}_vs_cloud_only"] = {"mean": round(est.value, 3), "ci95": [round(est.lo, 3), round(est.hi, 3)],
                                        "min": round(min(values), 3), "max": round(max(values), 3), "n": est.n}
    for name in strategies:
        mine = [r for r in rows if r["strategy"] == name]
        out[name] = {
            "tokens_per_s_by_position": [round(statistics.fmean(r["tokens_per_s"] for r in mine if r["position"] == p), 2)
                                         for p in range(len(strategies))],
            "ttft_ms": round(1e3 * statistics.fmean(r["ttft_s"] for r in mine), 1),
            "gap_ms": round(statistics.fmean(r["gap_ms_mean"] for r in mine), 2),
            "shadow_checks_per_generation": round(statistics.fmean(r["shadow_checks"] for r in mine), 1),
            "rounds": sum(r["rounds"] for r in mine)}
    return out


def turn_ratios(sessions: list[dict], tag: object = None) -> dict[str, list[float]]:
    """Per strategy, its tokens/s over the cloud-only run of the same turn, one value per turn."""
    by_turn: dict[tuple, dict[str, dict]] = {}
    for r in (r for s in sessions for r in s["turns"]):
        by_turn.setdefault((tag, r["session"], r["turn"]), {})[r["strategy"]] = r
    out: dict[str, list[float]] = {}
    for turn in by_turn.values():
        for name, r in turn.items():
            if name != "cloud-only":
                out.setdefault(name, []).append(r["tokens_per_s"] / turn["cloud-only"]["tokens_per_s"])
    return out


def pool(files: list[Path]) -> dict:
    """The replayed demo ratios and each strategy's interval against cloud-only over several runs' files."""
    ratios: dict[str, list[float]] = {}
    old = []
    for i, path in enumerate(files):
        sessions = json.loads(path.read_text())["sessions"]
        old += [round(s["old_demo"]["ratio"], 3) for s in sessions]
        for name, values in turn_ratios(sessions, i).items():
            ratios.setdefault(name, []).extend(values)
    out: dict = {"files": [str(f) for f in files], "old_demo_ratios": old}
    for name, values in ratios.items():
        est = mean_ci(values)
        out[f"{name}_vs_cloud_only"] = {"mean": round(est.value, 3), "ci95": [round(est.lo, 3), round(est.hi, 3)],
                                        "min": round(min(values), 3), "max": round(max(values), 3), "n": est.n}
    return out


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--pool", nargs="+", type=Path, metavar="FILE",
                        help="run nothing: pool the turns of these result files and print the intervals")
    parser.add_argument("--sessions", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=6, help="turns per strategy in each session")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES),
                        help="the strategies taking turns (cloud-only is always one)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.pool:
        print(json.dumps(pool(args.pool), indent=1))
        return
    if len(usable_cores()) < 2:
        raise SystemExit("needs two cores: the edge on one, the cloud on the other")
    strategies = tuple(dict.fromkeys(["cloud-only", *args.strategies]))
    sessions = [session(i, args.pairs, strategies) for i in range(args.sessions)]
    result = {"bench": "demo_fairness", "date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit(),
              "machine": {"cpu": cpu_model(), "platform": platform.platform()}, "engine": "llamacpp (auto)",
              "prompt": DEFAULT_PROMPT, "new_tokens": NEW_TOKENS, "strategies": strategies, "summary": summarise(sessions, strategies),
              "sessions": [{**s, "turns": [{k: v for k, v in r.items() if k != "token_ids"} for r in s["turns"]],
                            "old_demo": {k: ({kk: vv for kk, vv in v.items() if kk != "token_ids"}
                                             if isinstance(v, dict) else v) for k, v in s["old_demo"].items()}}
                           for s in sessions]}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, result)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
