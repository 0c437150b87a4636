"""How good is a drafter for its target? Held-out acceptance, tokens per round, cost c.

Acceptance is replayed exactly for greedy decoding over the target's own greedy answers
(distill/evaluate.py); c is the drafter's per-token latency over the target's, one torch thread each. An
EAGLE head is replayed as the edge drafts with it (int8 and fp16 features), beside --plain.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import DynamicCache

from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.loading import load_model
from hybridspec.common.protocol.wire import FeatureFormat
from hybridspec.distill.data import generate_samples, generate_with_features
from hybridspec.distill.evaluate import agreement_flags, eagle_report, evaluate, replay
from hybridspec.distill.prompts import FREEFORM_PROMPTS, heldout_prompts
from harness import arguments, commit, median, write_json, write_results


@torch.inference_mode()
def decode_latency(model, context: int = 96, tokens: int = 48) -> float:
    """Median seconds per single-token decode step with a KV cache of `context` tokens."""
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.ones(1, context, dtype=torch.long), past_key_values=cache, use_cache=True)
    times = []
    for _ in range(tokens):
        t0 = time.perf_counter()
        model(input_ids=torch.tensor([[5]]), past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
    return median(times)


def main() -> None:
    if sys.argv[1:2] == ["trace"]:
        parser = arguments(__doc__)
        parser.add_argument("--out", required=True, type=Path)
        parser.add_argument("--prompts", type=int, default=24, help="held-out prompts answered")
        parser.add_argument("--new-tokens", type=int, default=128)
        parser.add_argument("--threads", type=int, default=1)
        return trace(parser.parse_args(sys.argv[2:]))
    quality()


def quality() -> None:
    """Held-out and free-form acceptance, tokens per round and cost of a drafter or EAGLE head."""
    parser = arguments(__doc__)
    parser.add_argument("--drafter", default=str(default_paths()["drafter"]))
    parser.add_argument("--target", default=str(default_paths()["target"]))
    parser.add_argument("--plain", default=str(default_paths()["plain"]), help="plain drafter an eagle head is compared with")
    parser.add_argument("--heldout", type=int, default=64)
    parser.add_argument("--out", default="docs/drafter")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    target = load_model(args.target, device="cpu")
    drafter = load_model(args.drafter, device="cpu")
    if drafter.is_eagle:
        return eagle_main(args, target, drafter, out)
    # Seed 7 draws other task/topic combinations than the ones distill monitored (seed 1); topics stay held out.
    samples = generate_samples(target, heldout_prompts(args.heldout, seed=7), 128, 0.0, 8, 1, "held-out references")
    rep = evaluate(drafter.model, drafter.head_ids, samples, drafter.device, gammas=(4, 8))
    freeform = generate_samples(target, FREEFORM_PROMPTS, 128, 0.0, 8, 1, "free-form references")
    rep_free = evaluate(drafter.model, drafter.head_ids, freeform, drafter.device, gammas=(4, 8))
    torch.set_num_threads(1)
    t_target = decode_latency(target.model)
    t_drafter = decode_latency(drafter.model)
    result = {"drafter": args.drafter, "heldout_prompts": args.heldout,
              "heldout_tokens": sum(len(s.ids) - s.start for s in samples),
              "acceptance_alpha": rep.agreement, "freeform_prompts": len(FREEFORM_PROMPTS),
              "freeform_alpha": rep_free.agreement, "freeform_tokens_per_round": rep_free.tokens_per_round,
              "accepted_per_drafted": rep.acceptance,
              "tokens_per_round": rep.tokens_per_round, "per_position": rep.per_position,
              "target_ms_per_token": t_target * 1e3, "drafter_ms_per_token": t_drafter * 1e3,
              "c": t_drafter / t_target}
    write_results(out, result, markdown(result), indent=2)


def eagle_main(args, target, drafter, out: Path) -> None:
    """An EAGLE head: the same held-out and free-form sets, replayed exactly as the edge drafts
    (features through the wire format, the head's own features inside a block), for both formats."""
    samples, feats = generate_with_features(target, heldout_prompts(args.heldout, seed=7), 128, 0.0, 8, 1,
                                            "held-out references")
    free, free_feats = generate_with_features(target, FREEFORM_PROMPTS, 128, 0.0, 8, 1, "free-form references")
    reps = {fmt.value: (eagle_report(drafter, samples, feats, target.vocab_size, fmt),
                        eagle_report(drafter, free, free_feats, target.vocab_size, fmt))
            for fmt in (FeatureFormat.INT8, FeatureFormat.FP16)}
    plain = load_model(args.plain, device="cpu")
    plain_reps = [evaluate(plain.model, plain.head_ids, x, plain.device, gammas=(4, 8)) for x in (samples, free)]
    torch.set_num_threads(1)
    t_target = decode_latency(target.model)
    t_head = eagle_latency(drafter.model)
    hidden = drafter.model.hidden_size
    result = {"drafter": args.drafter, "kind": "eagle", "heldout_prompts": args.heldout,
              "heldout_tokens": sum(len(s.ids) - s.start for s in samples), "freeform_prompts": len(FREEFORM_PROMPTS),
              "freeform_tokens": sum(len(s.ids) - s.start for s in free),
              "formats": {fmt: {"heldout": asdict(h), "freeform": asdict(f),
                                "feature_bytes_per_round_g4": f.tokens_per_round[4] * (
                                    hidden + 2 if fmt == "int8" else 2 * hidden)}
                          for fmt, (h, f) in reps.items()},
              "plain": {"drafter": args.plain, "heldout": asdict(plain_reps[0]), "freeform": asdict(plain_reps[1])},
              "target_ms_per_token": t_target * 1e3, "drafter_ms_per_token": t_head * 1e3, "c": t_head / t_target}
    write_results(out, result, eagle_markdown(result), indent=2)


@torch.inference_mode()
def eagle_latency(head, context: int = 96, tokens: int = 48) -> float:
    """Median seconds per drafted token of an EAGLE head (one position fed with its own feature)."""
    cache = DynamicCache(config=head.config)
    f = torch.randn(1, context, head.hidden_size)
    out = head(f, torch.ones(1, context, dtype=torch.long), torch.arange(1, context + 1)[None], cache=cache)
    last, times = out[:, -1:], []
    for i in range(tokens):
        t0 = time.perf_counter()
        last = head(last, torch.tensor([[5]]), torch.tensor([[context + 1 + i]]), cache=cache)
        head.logits(last).argmax()
        times.append(time.perf_counter() - t0)
    return median(times)


def eagle_markdown(r: dict) -> str:
    """The table written to results.md for an EAGLE head."""
    lines = ["| metric | int8 features | fp16 features | plain drafter (same references) |", "|---|---|---|---|"]
    i8, f16, plain = r["formats"]["int8"], r["formats"]["fp16"], r["plain"]
    for name, key in (("held-out (template shapes, unseen topics)", "heldout"), ("free-form (unseen shapes)", "freeform")):
        lines.append(f"| {name}: α (eagle: first draft of a round; plain: per token) | {i8[key]['agreement']:.3f} | "
                     f"{f16[key]['agreement']:.3f} | {plain[key]['agreement']:.3f} |")
        for g in (4, 8):
            lines.append(f"| {name}: tokens per round / accepted per drafted, γ = {g} | " + " | ".join(
                f"{x[key]['tokens_per_round'][g]:.2f} / {x[key]['acceptance'][g]:.3f}" for x in (i8, f16, plain)) + " |")
        pos = [", ".join(f"{p:.2f}" for p in x[key]["per_position"][4]) for x in (i8, f16, plain)]
        lines.append(f"| {name}: P(position j accepted \\| reached), γ = 4 | {pos[0]} | {pos[1]} | {pos[2]} |")
    lines.append(f"| feature bytes per round, free-form, γ = 4 | {i8['feature_bytes_per_round_g4']:.0f} | "
                 f"{f16['feature_bytes_per_round_g4']:.0f} | 0 |")
    lines.append(f"| per-token latency, target / head (1 thread) | {r['target_ms_per_token']:.1f} ms / "
                 f"{r['drafter_ms_per_token']:.2f} ms | | |")
    lines.append(f"| c = head / target | {r['c']:.3f} | | |")
    return "\n".join(lines) + "\n"


def markdown(r: dict) -> str:
    """The tables written to results.md."""
    lines = ["| metric | value |", "|---|---|",
             f"| held-out prompts / tokens | {r['heldout_prompts']} / {r['heldout_tokens']} |",
             f"| greedy acceptance α (drafter argmax = target token) | {r['acceptance_alpha']:.3f} |"]
    lines.append(f"| free-form prompts (no template's shape): α / tokens per round at γ = 4 | "
                 f"{r['freeform_alpha']:.3f} / {r['freeform_tokens_per_round'][4]:.2f} |")
    for g in (4, 8):
        lines.append(f"| γ = {g}: tokens per verify round / accepted per drafted | "
                     f"{r['tokens_per_round'][g]:.2f} / {r['accepted_per_drafted'][g]:.3f} |")
    lines += [f"| per-token decode latency, target / drafter (1 thread) | {r['target_ms_per_token']:.1f} ms / "
              f"{r['drafter_ms_per_token']:.1f} ms |", f"| c = drafter / target | {r['c']:.3f} |"]
    pos = ", ".join(f"{p:.2f}" for p in r["per_position"][8])
    lines.append(f"| γ = 8: P(position j accepted \\| reached), j = 1..8 | {pos} |")
    return "\n".join(lines) + "\n"


def trace(args) -> None:
    """The shipped pair's agreement flags along the target's greedy answers (the GPU suite's trace)."""
    torch.set_num_threads(args.threads)
    paths = default_paths()
    began = time.perf_counter()
    target = load_model(str(paths["target"]), device="cpu")
    drafter = load_model(str(paths["drafter"]), device="cpu")
    # Seed 7: the held-out task/topic draws the quality report uses.
    samples = generate_samples(target, heldout_prompts(args.prompts, seed=7), args.new_tokens, 0.0, 8, 1,
                               "target's greedy answers")
    flags = agreement_flags(drafter.model, drafter.head_ids, samples, drafter.device)
    positions = {}
    for gamma in (4, 8):
        rounds, drafted, accepted, tries, hits = replay(flags, gamma)
        positions[str(gamma)] = {"alpha_by_position": [round(h / t, 4) if t else None for h, t in zip(hits, tries)],
                                 "accepted_per_drafted": round(accepted / max(drafted, 1), 4),
                                 "tokens_per_round": round(sum(map(len, flags)) / max(rounds, 1), 4)}
    total = sum(map(len, flags))
    write_json(args.out, {
        "what": "drafter-agrees-with-target flags over the target's greedy answers (1 = the drafter's argmax "
                "is the target's token at that position)",
        "target": paths["target"].name, "drafter": paths["drafter"].name, "prompts": args.prompts,
        "new_tokens": args.new_tokens, "tokens": total, "agreement": round(sum(map(sum, flags)) / max(total, 1), 4),
        "by_gamma": positions, "flags": ["".join("1" if f else "0" for f in row) for row in flags],
        "date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": "this repository's CPU machine, "
        f"{args.threads} torch thread(s)", "seconds": round(time.perf_counter() - began, 1),
        "command": f"python bench/drafter_quality.py trace --out {args.out}"})


if __name__ == "__main__":
    main()
