"""Does drafting on the edge's core slow the cloud's decoding on the other? How far the two emulated
hosts of a run on one machine (edge on core 0, cloud on core 1) are from two machines.

    python bench/drafting_interference.py [--prompts 4] [--new-tokens 96] [--repeats 3] [--out FILE]

llama-cpp-python decodes the embedded target greedily on the cloud core (one thread, each prompt from
an empty cache) while a process on the edge core runs the embedded drafter's llama.cpp LM (as the
default edge's guesses do) for a share of the time: none, a quarter (about what a shadowed window
costs), all of it. The shares take turns, repeated, so that drift hits each. Milliseconds per decoded
token (prefill left out) per share, and their ratio to the idle edge core's. Prints one JSON object.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.gguf import find_gguf
from hybridspec.common.models.loading import load_model
from hybridspec.distill.prompts import FREEFORM_PROMPTS
from hybridspec.edge.prompt import encode_prompt
from harness import CLOUD_CORE, EDGE_CORE, arguments, header, median, pin, report

SHARES = (0.0, 0.25, 1.0)  # of the edge core's time spent drafting


def draft_for_a_share(share: float, stop, ready) -> None:
    """On the edge core: feed the drafter one token at a time, busy for `share` of the time."""
    pin(EDGE_CORE)
    from hybridspec.edge.llamacpp_lm import LlamaCppLM

    loaded = load_model(default_paths()["drafter"], device="cpu")
    lm = LlamaCppLM.open(loaded.llama, loaded.head_ids, loaded.vocab_size)
    lm.advance([5, 6])
    ready.set()
    step = 0
    while not stop.is_set():
        if share == 0:
            time.sleep(0.05)
            continue
        started = time.perf_counter()
        if len(lm.cached) >= 300:
            lm.advance([5, 6 + step % 2])  # back to a short context, as a new generation would
        lm.feed([1000 + step % 400])
        step += 1
        time.sleep((time.perf_counter() - started) * (1 - share) / share)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    from llama_cpp import Llama

    paths = default_paths()
    tokenizer = load_model(paths["drafter"], device="cpu").tokenizer
    prompts = [encode_prompt(tokenizer, p, chat=True) for p in FREEFORM_PROMPTS[:args.prompts]]
    pin(CLOUD_CORE)
    llm = Llama(str(find_gguf(paths["target"])), n_ctx=2048, n_threads=1, n_threads_batch=1, flash_attn=True,
                verbose=False)

    def decode_ms(prompt: list[int]) -> float:
        llm.reset()
        stamps = []
        for _ in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == args.new_tokens:
                break
        return (stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1)

    spawn = mp.get_context("spawn")  # a fresh interpreter: torch's thread pools do not survive a fork
    ms: dict[float, list[float]] = {share: [] for share in SHARES}
    for _ in range(args.repeats):
        for share in SHARES:
            stop, ready = spawn.Event(), spawn.Event()
            pin(EDGE_CORE)  # the child starts (imports, loads) on the edge core, not beside the decoding
            child = spawn.Process(target=draft_for_a_share, args=(share, stop, ready))
            child.start()
            pin(CLOUD_CORE)
            if not ready.wait(300):
                raise SystemExit("the drafter process did not start within 300 s")
            try:
                ms[share] += [decode_ms(p) for p in prompts]
            finally:
                stop.set()
                child.join()
    idle = statistics.mean(ms[0.0])
    report({**header(engine="llama.cpp (llama-cpp-python) target; the edge's llama.cpp drafter LM"),
            "cloud_core": CLOUD_CORE, "edge_core": EDGE_CORE, "prompts": len(prompts), "new_tokens": args.new_tokens,
            "repeats": args.repeats, "shares": {
                str(share): {"ms_per_token_mean": round(statistics.mean(v), 3),
                             "ms_per_token_median": round(median(v), 3),
                             "vs_idle_edge_core": round(statistics.mean(v) / idle, 3),
                             "ms_per_token_all": [round(x, 3) for x in v]}
                for share, v in ms.items()}}, args.out)


if __name__ == "__main__":
    main()
