"""`pair check`'s prediction of forced hybrid over cloud-only, against a measured run of the same pair.

    python bench/pair_prediction.py [--target T] [--drafter D] [--repeats 2] [--out FILE]

1. `hybridspec pair check` (in this process, on the edge's core 0): its report, and how long it took.
2. `cloud serve` with its defaults (the Ray pool, direct verify) on core 1; on core 0 two edge workers,
   one `--cloud-only`, one forced hybrid (`--no-cloud-only-switch`, adaptive γ), both with the drafter
   on one thread (`--torch-threads 1`, as pair check measures it). Each writes pair check's prompts
   (`new_tokens` each, chat template), after one generation of warm-up; the two alternate prompt by
   prompt, `--repeats` times. Tokens/s is the generated tokens over the generation's wall time.
3. Measured: the ratio of the two modes' tokens/s, summed over all generations, and per prompt
   (geometric mean); the prediction's error against it. Greedy: both modes write the same tokens,
   which is checked.

The machine is shared with other work: the two runs interleave so that a busy moment hits both.
"""
from __future__ import annotations

import math
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness import EDGE_CORE, arguments, cloud, header, pin, report, usable_cores

from hybridspec.common.models.embedded import resolve
from hybridspec.lab.pairs import PairCheckConfig, _encode, check, load_prompts


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--target", default="")
    parser.add_argument("--drafter", default="")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if EDGE_CORE in usable_cores():
        pin(EDGE_CORE)
    # 1. The prediction.
    cfg = PairCheckConfig(target=args.target, drafter=args.drafter)
    started = time.perf_counter()
    predicted = check(cfg)
    check_s = time.perf_counter() - started
    # 2. The measured run.
    target = resolve(cfg.target, "target")
    with cloud({"target": target}) as (_, address):
        measured = measure(address, cfg, args.repeats)
    ratio = measured["hybrid_tokens_per_s"] / measured["cloud_only_tokens_per_s"]
    speedup = predicted["here"]["speedup"]
    result = {**header(machine=f"{os.cpu_count()} cores, shared with other work"),
              "command": "python bench/pair_prediction.py" + (f" --target {args.target}" if args.target else "")
                         + (f" --drafter {args.drafter}" if args.drafter else ""),
              "pair_check_seconds": round(check_s, 1), "pair_check": predicted,
              "measured": measured, "measured_ratio": round(ratio, 3), "predicted_ratio": speedup,
              "prediction_error": round(speedup / ratio - 1, 3)}
    report(result, args.out)


def measure(address: str, cfg: PairCheckConfig, repeats: int) -> dict:
    """Forced hybrid and cloud-only edges over the running cloud, interleaved prompt by prompt."""
    from hybridspec.cli.edge_options import build_worker
    from hybridspec.edge.config import EdgeConfig

    target_dir = _tokenizer_dir(resolve(cfg.target, "target"))
    prompts = [_encode(target_dir, p) for p in load_prompts(cfg.prompts)]
    common = dict(cloud=address, drafter=resolve(cfg.drafter, "drafter"), max_new_tokens=cfg.new_tokens,
                  torch_threads=cfg.threads, max_draft=cfg.max_draft)
    workers = {"cloud_only": build_worker(EdgeConfig.of(**common, cloud_only=True)),
               "hybrid": build_worker(EdgeConfig.of(**common, cloud_only_switch=False))}
    try:
        runs: dict[str, list[tuple[int, float]]] = {mode: [] for mode in workers}
        texts: dict[str, dict[int, list[int]]] = {mode: {} for mode in workers}
        rounds = accepted = 0
        spent = {"wall_s": 0.0, "draft_s": 0.0, "cloud_s": 0.0, "gamma_sum": 0}
        for worker in workers.values():
            worker.generate(prompts[0])  # warm-up: the hybrid worker learns its rates here
        for _ in range(repeats):
            for i, prompt in enumerate(prompts):
                for mode in (("cloud_only", "hybrid") if i % 2 else ("hybrid", "cloud_only")):
                    gen = workers[mode].generate(prompt)
                    runs[mode].append((len(gen.token_ids), gen.stats.wall_s))
                    texts[mode][i] = gen.token_ids
                    if mode == "hybrid":
                        rounds, accepted = rounds + gen.stats.rounds, accepted + gen.stats.accepted
                        for key in spent:
                            spent[key] += getattr(gen.stats, key)
    finally:
        for worker in workers.values():
            worker.close()
    rate = {mode: sum(n for n, _ in r) / sum(s for _, s in r) for mode, r in runs.items()}
    per_prompt = [(n1 / s1) / (n0 / s0) for (n0, s0), (n1, s1) in zip(runs["cloud_only"], runs["hybrid"])]
    return {"prompts": len(prompts), "repeats": repeats, "new_tokens": cfg.new_tokens,
            "cloud_only_tokens_per_s": round(rate["cloud_only"], 2), "hybrid_tokens_per_s": round(rate["hybrid"], 2),
            "per_prompt_ratio_geomean": round(math.exp(sum(map(math.log, per_prompt)) / len(per_prompt)), 3),
            "hybrid_rounds": rounds, "hybrid_accepted_per_round": round(accepted / max(1, rounds), 3),
            "hybrid_mean_gamma": round(spent["gamma_sum"] / max(1, rounds), 2),
            "hybrid_ms_per_round": {k: round(v * 1e3 / max(1, rounds), 2) for k, v in spent.items() if k != "gamma_sum"},
            "identical_tokens": texts["cloud_only"] == texts["hybrid"]}


def _tokenizer_dir(target: str):
    from hybridspec.common.models.pairing import describe

    return describe(target).tokenizer.directory


if __name__ == "__main__":
    main()
