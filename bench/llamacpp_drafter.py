"""The edge's drafter on llama.cpp against the same drafter on torch, and both against the target.

    taskset -c 1 python bench/llamacpp_drafter.py [--context 200] [--repeats 7] [--block 8]
        [--positions 400] [--out docs/engine/llamacpp-drafter.json]

The embedded plain drafter (4 layers, an 8,192-row head) written as a GGUF of each weight type (F16,
Q8_0, Q4_0; into a temporary copy of it) by common/models/drafter_gguf.py, run by edge/llamacpp_lm.py:

1. Agreement: along the target's own greedy continuation of chat prompts (the llama.cpp engine, Q4_1),
   its logits over the head against the torch drafter's (fp32): largest and mean |difference| and
   top-1 agreement over `--positions` positions; and how often each drafter's top-1 is the target's
   token (the greedy acceptance rate α a drafter would get).
2. Drafting cost, one thread (pin the process to one core with taskset): a greedy block of `--block`
   tokens drafted by `ModelDrafter.propose` after `--context` cached tokens — the whole drafting step,
   the LM and the sampling in Python, as the edge pays it — per token; and the LM's one-token feed
   alone. The drafters alternate repeat by repeat, so load drift hits all alike; medians.
3. The target's one-token pass after `--context` cached tokens: the llama.cpp engine on the shipped
   Q4_1 GGUF (the CPU default) and the torch engine on its fp32 checkpoint.
   c = the drafter's per-token time / the target's one-token time, against each engine.
Writes one JSON object to --out (and prints it).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridspec.cloud.engine.base import Feed
from hybridspec.cloud.engine.llamacpp_engine import LlamaCppEngine
from hybridspec.cloud.engine.torch_engine import engine_for
from hybridspec.common.models.drafter_gguf import GGUF_NAME, GGUF_WEIGHTS, convert_drafter
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.gguf import find_gguf
from hybridspec.common.models.loading import LoadedModel, load_model
from hybridspec.common.protocol.wire import SamplingParams
from hybridspec.edge.draft_lm import DraftLM, TorchLM
from hybridspec.edge.drafter import ModelDrafter
from hybridspec.edge.llamacpp_lm import LlamaCppLM
from hybridspec.edge.prompt import encode_prompt
from hybridspec.edge.proposal import DraftSettings, Drafting
from harness import arguments, cpu_model, median, pass_times, usable_cores

QUESTIONS = ("Why is the sky blue?", "Write a haiku about autumn leaves.", "What is 17 times 3? Explain.",
             "Give me three tips for learning Python.", "Summarise the plot of Romeo and Juliet.",
             "How do vaccines work?", "Name some uses of copper.", "What should I pack for a beach holiday?")


def target_texts(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The target's greedy continuation of each prompt on the llama.cpp engine (the shipped Q4_1)."""
    engine = LlamaCppEngine(find_gguf(default_paths()["target"]), 4096, 1, threads=1)
    texts = []
    for prompt in prompts:
        kv, feed, text = engine.new_sequence(), prompt, []
        while len(text) < new_tokens:
            engine.reserve(kv, len(feed))
            feed = [int(engine.forward([Feed(kv, feed, scored=True)])[0].logits[-1].argmax())]
            text += feed
        engine.release(kv)
        texts.append(text)
    return texts


@torch.inference_mode()
def agreement(torch_drafter: LoadedModel, llama_drafter: LoadedModel, prompts: list[list[int]],
              texts: list[list[int]]) -> dict:
    """Along the target's texts: the llama.cpp drafter's top-1 and logits over the head against the
    torch drafter's, and each one's top-1 against the target's token."""
    head, vocab = torch_drafter.head_ids, torch_drafter.vocab_size
    diffs, agree, ours_alpha, theirs_alpha = [], 0, 0, 0
    for prompt, text in zip(prompts, texts):
        ours, theirs = LlamaCppLM.open(llama_drafter.llama, head, vocab), TorchLM(torch_drafter, vocab)
        a, b = ours.advance(prompt), theirs.advance(prompt)
        for token in text:
            diffs.append((a[head] - b[head]).abs().max().item())
            agree += int(a.argmax() == b.argmax())
            ours_alpha += int(a.argmax() == token)
            theirs_alpha += int(b.argmax() == token)
            a, b = ours.feed([token]), theirs.feed([token])
    n = len(diffs)
    return {"positions": n, "top1_agreement": round(agree / n, 4), "max_abs_diff": round(max(diffs), 4),
            "mean_max_abs_diff": round(statistics.mean(diffs), 4), "alpha_vs_target": round(ours_alpha / n, 4),
            "torch_alpha_vs_target": round(theirs_alpha / n, 4)}


def block_ms(drafter: ModelDrafter, context: list[int], block: int) -> float:
    """One greedy block after `context` (whose KV is cached but for its last token), per token."""
    t0 = time.perf_counter()
    proposal = drafter.propose(context, block, fallback=False)
    assert len(proposal.ids) == block
    return (time.perf_counter() - t0) * 1000 / block


def feed_ms(lm: DraftLM, context: list[int], tokens: int) -> float:
    """The LM's one-token feed after `context`, averaged over `tokens` tokens."""
    lm.advance(context)
    t0 = time.perf_counter()
    for i in range(tokens):
        lm.feed([1500 + i])
    return (time.perf_counter() - t0) * 1000 / tokens


@torch.inference_mode()
def drafting(drafters: dict[str, LoadedModel], context_len: int, block: int, repeats: int) -> dict:
    """Per-token drafting and feed times of every drafter, alternating repeat by repeat."""
    settings = DraftSettings(sampling=SamplingParams(temperature=0.0), vocab_size=49152, stop_ids=frozenset(),
                             drafting=Drafting(fallback_threshold=0.0))
    context = list(range(1000, 1000 + context_len))
    lms = {name: (TorchLM(d, 49152) if d.llama is None else LlamaCppLM.open(d.llama, d.head_ids, 49152))
           for name, d in drafters.items()}
    return time_drafters({name: ModelDrafter(drafters[name], settings, lm) for name, lm in lms.items()},
                         context, block, repeats)


def time_drafters(runs: dict, context: list[int], block: int, repeats: int) -> dict:
    """Per drafter (by key): the median ms per drafted token of a greedy block of `block` after
    `context`, and of the LM's one-token feed, alternating drafters repeat by repeat."""
    for run in runs.values():
        run.propose(context, block, fallback=False)  # warm: the context's KV is cached from here on
    times: dict = {key: {"block": [], "feed": []} for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            times[key]["block"].append(block_ms(run, context, block))
            times[key]["feed"].append(feed_ms(run.lm, context, block))
    return {key: {"draft_ms_per_token": round(median(t["block"]), 3),
                  "feed_ms": round(median(t["feed"]), 3)} for key, t in times.items()}


@torch.inference_mode()
def target_ms(context_len: int, repeats: int) -> dict:
    """The target's one-token pass after `context_len` cached tokens, on both engines."""
    target = default_paths()["target"]
    engines = {"llamacpp": LlamaCppEngine(find_gguf(target), 4096, 1, threads=1),
               "torch": engine_for(load_model(target, device="cpu", engine="torch").model, 4096)}
    context = list(range(1000, 1000 + context_len))
    return {name: {"weights": engine.capabilities.dtype,
                   "t1_ms": round(median(pass_times(engine, context, context[:1], 4 * repeats)), 3)}
            for name, engine in engines.items()}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--positions", type=int, default=400)
    parser.add_argument("--out", type=Path, default=Path("docs/engine/llamacpp-drafter.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    plain = default_paths()["plain"]
    result: dict = {"cpu": cpu_model(), "cores": usable_cores(), "threads": 1, "context": args.context,
                    "block": args.block, "drafter": str(plain)}
    with tempfile.TemporaryDirectory() as workdir:
        drafters = {"torch": load_model(plain, device="cpu", engine="torch")}
        result["conversion"] = {}
        for weights in GGUF_WEIGHTS:
            copy = Path(workdir) / weights
            shutil.copytree(plain, copy, ignore=shutil.ignore_patterns("drafter.gguf", "input-embeddings.npy",
                                                                       "llamacpp-drafter.json"))
            t0 = time.perf_counter()
            convert_drafter(copy, weights, log=lambda _: None)
            result["conversion"][weights] = {"seconds": round(time.perf_counter() - t0, 2),
                                             "gguf_mb": round((copy / GGUF_NAME).stat().st_size / 2**20, 1)}
            drafters[f"llamacpp-{weights}"] = load_model(copy, device="cpu", engine="llamacpp")
        prompts = [encode_prompt(drafters["torch"].tokenizer, q, chat=True) for q in QUESTIONS]
        texts = target_texts(prompts, max(1, args.positions // len(prompts)))
        result["agreement"] = {name: agreement(drafters["torch"], d, prompts, texts)
                               for name, d in drafters.items() if d.llama is not None}
        result["drafting"] = drafting(drafters, args.context, args.block, args.repeats)
    result["target"] = target_ms(args.context, args.repeats)
    result["c"] = {engine: {name: round(d["draft_ms_per_token"] / t["t1_ms"], 3)
                            for name, d in result["drafting"].items()}
                   for engine, t in result["target"].items()}
    text = json.dumps(result, indent=1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print(text)



if __name__ == "__main__":
    main()
