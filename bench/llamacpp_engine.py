"""The llama.cpp engine against the torch engine and against llama.cpp alone, in one run.

    python bench/llamacpp_engine.py [--context 200] [--repeats 5] [--prompts 8] [--new-tokens 96]

1. Cost curve: t(M) = one engine pass of M scored tokens after `--context` cached tokens, M = 1..32,
   for both engines on the embedded target (llama.cpp: the shipped Q4_1 GGUF; torch: its fp32
   dequantisation), one thread on one core, the two alternating so load drift hits both alike.
   v = t(5)/t(1) is what a γ = 4 round costs in target-token times.
2. Weight types: the shipped file re-quantised (F16, Q8_0, Q4_0), each with flash attention on and
   off: t(1), t(5), v, and whether a block of 8 scores exactly as its tokens one by one (largest
   logit difference, top-1 flips), alone and batched with another session.
3. Cloud-only decoding end to end: `cloud serve --engine llamacpp` on core 1 and `--cloud-only` edges
   on core 0 (our gRPC path, prompt prefill included), against llama-cpp-python's own `Llama` greedy
   on core 1 with the same GGUF and prompts: tokens/s over `--prompts` chat prompts.
Prints one JSON object.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridspec.cloud.engine.base import Feed
from hybridspec.cloud.engine.llamacpp_engine import LlamaCppEngine
from hybridspec.cloud.engine.torch_engine import engine_for
from hybridspec.cloud.process import start_cloud_process, stop_cloud_process
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.gguf import find_gguf, requantize
from hybridspec.common.models.loading import load_model
from hybridspec.distill.prompts import FREEFORM_PROMPTS
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.prompt import encode_prompt
from hybridspec.edge.worker import EdgeWorker
from harness import CLOUD_CORE, EDGE_CORE, arguments, cpu_model, median, pass_times, pin


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


def cloud_only_grpc(prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Tokens/s of --cloud-only edges through our gRPC front door, one prompt after another."""
    proc, address, _ = start_cloud_process({"backend": "inprocess", "engine": "llamacpp", "torch_threads": 1},
                                           cores={CLOUD_CORE})
    pin(EDGE_CORE)
    try:
        config = EdgeConfig(cloud=address, max_new_tokens=new_tokens, cloud_only=True)
        drafter = load_model(default_paths()["drafter"], device="cpu")  # loaded, never run: --cloud-only
        with VerifierClient(address) as client:
            worker = EdgeWorker(drafter, client, config)
            worker.generate(prompts[0][:8])  # warm the channel and the server
            texts, t0 = [], time.perf_counter()
            for prompt in prompts:
                texts.append(worker.generate(prompt).token_ids)
            return sum(map(len, texts)) / (time.perf_counter() - t0), texts
    finally:
        stop_cloud_process(proc)


def llamacpp_alone(prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Tokens/s of llama-cpp-python's own `Llama` decoding greedily, prompt prefill included (flash
    attention on and no repetition penalty, as our engine decodes, so the texts can be compared)."""
    from llama_cpp import Llama

    pin(CLOUD_CORE)
    llm = Llama(str(find_gguf(default_paths()["target"])), n_ctx=2048, n_threads=1, n_threads_batch=1,
                flash_attn=True, verbose=False)
    stop = {llm.token_eos()}
    texts, t0 = [], time.perf_counter()
    for prompt in prompts:
        llm.reset()
        text = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            text.append(token)  # an end-of-sequence token is decoded too, and our edge counts it
            if token in stop or len(text) == new_tokens:
                break
        texts.append(text)
    return sum(map(len, texts)) / (time.perf_counter() - t0), texts


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--skip-curve", action="store_true", help="only the end-to-end comparison")
    args = parser.parse_args()
    result = {"cpu": cpu_model()}
    if not args.skip_curve:
        result["cost"] = cost_curve(args.context, args.repeats)
        with tempfile.TemporaryDirectory() as workdir:
            result["weight_types"] = weight_types(args.context, args.repeats, Path(workdir))
    tokenizer = load_model(default_paths()["drafter"], device="cpu").tokenizer
    prompts = [encode_prompt(tokenizer, p, chat=True) for p in FREEFORM_PROMPTS[:args.prompts]]
    ours, ours_texts = cloud_only_grpc(prompts, args.new_tokens)
    alone, alone_texts = llamacpp_alone(prompts, args.new_tokens)
    result["cloud_only"] = {"ours_grpc_tokens_per_s": round(ours, 1), "llamacpp_alone_tokens_per_s": round(alone, 1),
                            "ratio": round(ours / alone, 2), "tokens": [len(t) for t in ours_texts],
                            "same_text": sum(a == b for a, b in zip(ours_texts, alone_texts))}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
