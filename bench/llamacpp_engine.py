"""The llama.cpp engine against the torch engine, and per weight type, in one run.

    python bench/llamacpp_engine.py [--context 200] [--repeats 5]

1. Cost curve: t(M) = one engine pass of M scored tokens after `--context` cached tokens, M = 1..32,
   for both engines on the embedded target (llama.cpp: the shipped Q4_1 GGUF; torch: its fp32
   dequantisation), one thread on one core, the two alternating so load drift hits both alike.
   v = t(5)/t(1) is what a γ = 4 round costs in target-token times.
2. Weight types: the shipped file re-quantised (F16, Q8_0, Q4_0), each with flash attention on and
   off: t(1), t(5), v, and whether a block of 8 scores exactly as its tokens one by one (largest
   logit difference, top-1 flips), alone and batched with another session.
Prints one JSON object. (Cloud-only decoding against llama.cpp alone, this script's third part until
2026-11-27, is measured layer by layer by bench/cloud_only_overhead.py.)
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridspec.cloud.engine.base import Feed
from hybridspec.cloud.engine.llamacpp_engine import LlamaCppEngine
from hybridspec.cloud.engine.torch_engine import engine_for
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.gguf import find_gguf, requantize
from hybridspec.common.models.loading import load_model
from harness import CLOUD_CORE, arguments, cpu_model, median, pass_times, pin, report


@torch.inference_mode()
def cost_curve(context_len: int, repeats: int) -> dict:
    """t(M) for M = 1..32 on both engines, alternating M by M."""
    pin(CLOUD_CORE)
    torch.set_num_threads(1)
    target = default_paths()["target"]
    engines = {"llamacpp": LlamaCppEngine(find_gguf(target), 4096, 4, threads=1),
               "torch": engine_for(load_model(target, device="cpu").model, 4096)}
    context = list(range(1000, 1000 + context_len))
    curve: dict[str, dict[int, float]] = {name: {} for name in engines}
    for m in range(1, 33):
        for name, engine in engines.items():
            curve[name][m] = round(median(pass_times(engine, context, context[:m], repeats)), 2)
    out = {"dtypes": {name: e.capabilities.dtype for name, e in engines.items()}, "t_ms": curve}
    out["v_gamma4"] = {name: round(c[5] / c[1], 2) for name, c in curve.items()}
    out["t1_torch_over_llamacpp"] = round(curve["torch"][1] / curve["llamacpp"][1], 2)
    return out


def exactness(engine: LlamaCppEngine) -> dict:
    """A block of 8 after 200 tokens vs the same tokens one by one, alone and beside another session."""
    rng = torch.Generator().manual_seed(0)
    context, other = (torch.randint(100, 40000, (n,), generator=rng).tolist() for n in (200, 77))
    block = torch.randint(100, 40000, (8,), generator=rng).tolist()
    kv, kv2 = engine.new_sequence(), engine.new_sequence()
    for seq, tokens in ((kv, context), (kv2, other)):
        engine.reserve(seq, len(tokens))
        engine.forward([Feed(seq, tokens, scored=False)])
    singles = []
    for token in block:
        engine.reserve(kv, 1)
        singles.append(engine.forward([Feed(kv, [token], scored=True)])[0].logits)
    singles = torch.cat(singles)
    engine.truncate(kv, len(context))
    engine.reserve(kv, len(block))
    alone = engine.forward([Feed(kv, block, scored=True)])[0].logits
    engine.truncate(kv, len(context))
    engine.reserve(kv, len(block))
    engine.reserve(kv2, 3)
    batched = engine.forward([Feed(kv2, block[:3], scored=True), Feed(kv, block, scored=True)])[1].logits
    engine.release(kv)
    engine.release(kv2)
    return {"block_max_diff": float((alone - singles).abs().max()),
            "block_flips": int((alone.argmax(-1) != singles.argmax(-1)).sum()),
            "batched_max_diff": float((batched - singles).abs().max())}


def weight_types(context_len: int, repeats: int, workdir: Path) -> list[dict]:
    """t(1), t(5), v and exactness per weight type and flash-attention setting."""
    pin(CLOUD_CORE)
    shipped = find_gguf(default_paths()["target"])
    context = list(range(1000, 1000 + context_len))
    rows = []
    for weights in ("Q4_1", "Q4_0", "Q8_0", "F16"):
        path = shipped if weights == "Q4_1" else workdir / f"{weights}.gguf"
        if weights != "Q4_1":
            requantize(shipped, path, weights)
        for flash in (True, False):
            engine = LlamaCppEngine(path, 4096, 4, threads=1, flash_attention=flash)
            t1, t5 = (median(pass_times(engine, context, context[:m], repeats)) for m in (1, 5))
            rows.append({"weights": engine.capabilities.dtype, "flash_attention": flash, "t1_ms": round(t1, 2),
                         "t5_ms": round(t5, 2), "v": round(t5 / t1, 2), **exactness(engine)})
            del engine
    return rows


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    result = {"cpu": cpu_model(), "cost": cost_curve(args.context, args.repeats)}
    with tempfile.TemporaryDirectory() as workdir:
        result["weight_types"] = weight_types(args.context, args.repeats, Path(workdir))
    report(result)


if __name__ == "__main__":
    main()
