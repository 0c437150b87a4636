"""Where the time of one cloud-only token goes, layer by layer, against llama.cpp alone, in one run.

The same chat prompts through each layer in turn; while one runs, the clouds it does not talk to are
stopped. docs/engine.md has the method and the numbers. `--layers` picks some (llamacpp_alone, the base
of every ratio, always runs):

  llamacpp_alone       llama-cpp-python's own `Llama.generate` (what a CPU user would run instead)
  llamacpp_beside_ray  the same beside the default Ray cloud, awake and idle on its core: the ceiling
  engine               our LlamaCppEngine, one scored token per pass
  grpc_inprocess       `cloud serve --backend inprocess` + VerifierClient.generate
  decode_ray           `cloud serve`'s Ray pool, `Decode` from the replica's own endpoint (as the edge does)
  edge_ray             `edge generate --cloud-only`'s worker over the Ray pool
  edge_default_ray     the default edge's worker over the Ray pool
"""
from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

from hybridspec.cloud.engine.base import Feed
from hybridspec.cloud.engine.llamacpp_engine import LlamaCppEngine
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.gguf import GgufTarget, find_gguf, served_weights
from hybridspec.common.protocol.wire import DecodeSpec, GenerateSpec, SessionSpec
from hybridspec.distill.prompts import FREEFORM_PROMPTS
from hybridspec.edge.client import VerifierClient
from hybridspec.cli.edge_options import build_worker
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.prompt import encode_prompt
from hybridspec.common.models.loading import load_model
from hybridspec.lab.stats import bootstrap_ci
from harness import (CLOUD_CORE, EDGE_CORE, arguments, frozen, header, median, pin, process_tree, report, start_cloud,
                     stop_cloud)


def llamacpp_alone(llm, prompt: list[int], n: int) -> list[int]:
    """llama-cpp-python greedy, flash attention on, no repetition penalty (as our engine decodes). The
    cache is emptied first: `generate` would otherwise reuse the prefix the chat prompts share (their
    system message) and skip most of the prefill that every other layer pays."""
    llm.reset()
    out = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(token)
        if token == llm.token_eos() or len(out) == n:
            break
    return out


def engine_alone(engine: LlamaCppEngine, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    """Our engine with nothing around it: prefill, then one scored token per pass."""
    kv = engine.new_sequence()
    try:
        engine.reserve(kv, len(prompt))
        if len(prompt) > 1:  # the prompt's logits are not needed, but its last token's
            engine.forward([Feed(kv, prompt[:-1], scored=False)])
        out = [int(np.argmax(engine.forward([Feed(kv, prompt[-1:], scored=True)])[0].logits[-1].numpy()))]
        while out[-1] not in eos and len(out) < n:
            engine.reserve(kv, 1)
            out.append(int(np.argmax(engine.forward([Feed(kv, out[-1:], scored=True)])[0].logits[-1].numpy())))
        return out
    finally:
        engine.release(kv)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", default="", help="comma-separated layers to run (default: all)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    from llama_cpp import Llama

    paths = default_paths()
    gguf = find_gguf(paths["target"])
    drafter = load_model(paths["drafter"], device="cpu")  # the prompts' tokenizer
    prompts = [encode_prompt(drafter.tokenizer, p, chat=True) for p in FREEFORM_PROMPTS[:args.prompts]]
    n = args.new_tokens
    pin(CLOUD_CORE)
    llm = Llama(str(gguf), n_ctx=2048, n_threads=1, n_threads_batch=1, flash_attn=True, verbose=False)
    engine = LlamaCppEngine(gguf, 8192, 4, threads=1)
    target = GgufTarget(str(gguf), gguf, engine.vocab_size)
    eos = set(target.eos_token_ids)
    # No prefix reuse anywhere: every layer prefills each prompt, as llama.cpp alone does after its reset
    # (the layers decode the same prompts one after another, so reuse would favour all but the first).
    inproc, inproc_address = start_cloud({"backend": "inprocess", "pass_cost_tokens": 0, "prefix_scope": "off"},
                                         pin_edge=False)
    ray, ray_address = start_cloud({"prefix_scope": "off"}, pin_edge=False)  # else the defaults
    clients = {"grpc_inprocess": VerifierClient(inproc_address), "decode_ray": VerifierClient(ray_address)}
    # Built as `edge generate` builds them: the default drafter runs on llama.cpp, not torch.
    workers = {"edge_ray": build_worker(EdgeConfig.of(cloud=ray_address, max_new_tokens=n, cloud_only=True)),
               "edge_default_ray": build_worker(EdgeConfig.of(cloud=ray_address, max_new_tokens=n))}

    def grpc(prompt: list[int]) -> list[int]:
        pin(EDGE_CORE)
        return list(clients["grpc_inprocess"].generate(GenerateSpec(prompt_ids=tuple(prompt), max_new_tokens=n)))

    def decode(prompt: list[int]) -> list[int]:
        pin(EDGE_CORE)
        client = clients["decode_ray"]
        session = client.open_session(SessionSpec("", tuple(prompt))).session_id
        try:
            return list(client.decode(DecodeSpec(session, 0, len(prompt), n)))
        finally:
            client.close_session_later(session)

    def edge(name: str, prompt: list[int]) -> list[int]:
        pin(EDGE_CORE)
        return workers[name].generate(prompt).token_ids

    def local(fn):
        def run(prompt):
            pin(CLOUD_CORE)
            return fn(prompt)
        return run

    layers = {
        "llamacpp_alone": local(lambda p: llamacpp_alone(llm, p, n)),
        "llamacpp_beside_ray": local(lambda p: llamacpp_alone(llm, p, n)),
        "engine": local(lambda p: engine_alone(engine, p, n, eos)),
        "grpc_inprocess": grpc,
        "decode_ray": decode,
        "edge_ray": lambda p: edge("edge_ray", p),
        "edge_default_ray": lambda p: edge("edge_default_ray", p),
    }
    chosen = [name for name in args.layers.split(",") if name]
    if unknown := sorted(set(chosen) - set(layers)):
        raise SystemExit(f"unknown layers {', '.join(unknown)}; the layers are {', '.join(layers)}")
    if chosen:
        layers = {name: fn for name, fn in layers.items() if name in chosen or name == "llamacpp_alone"}
    names = list(layers)
    # The cloud each layer talks to; every other one is stopped while it runs.
    serving = {"grpc_inprocess": inproc,
               **{name: ray for name in ("llamacpp_beside_ray", "decode_ray", "edge_ray", "edge_default_ray")}}
    try:
        for fn in layers.values():  # warm every path once
            fn(prompts[0][:16])
        ms: dict[str, list[float]] = {k: [] for k in layers}
        texts: dict[str, list[list[int]]] = {k: [] for k in layers}
        for r in range(args.repeats):
            for i, prompt in enumerate(prompts):
                turn = (r * len(prompts) + i) % len(names)
                for name in names[turn:] + names[:turn]:
                    with frozen([p for c in (inproc, ray) if c is not serving.get(name) for p in process_tree(c.pid)]):
                        t0 = time.perf_counter()
                        out = layers[name](prompt)
                        ms[name].append((time.perf_counter() - t0) * 1e3 / len(out))
                    if r == 0:
                        texts[name].append(out)
    finally:
        for c in clients.values():
            c.close()
        for worker in workers.values():
            worker.close()
        stop_cloud(inproc)
        stop_cloud(ray)
    base = median(ms["llamacpp_alone"])
    # Each generation against llama.cpp alone on the same prompt, moments before or after: the geometric
    # mean of the ratios, with its 95 % percentile-bootstrap interval over the generations.
    paired = {name: bootstrap_ci([a / b for a, b in zip(ms["llamacpp_alone"], v)], statistics.geometric_mean)
              for name, v in ms.items()}
    result = {**header(weights=served_weights(paths["target"])),
              "prompts": len(prompts), "new_tokens": n, "repeats": args.repeats,
              "other_clouds_stopped": True, "layers": {
        name: {"ms_per_token": round(median(v), 3), "ms_per_token_all": [round(x, 3) for x in v],
               "vs_llamacpp_alone": round(base / median(v), 3),
               "vs_llamacpp_alone_paired": round(paired[name].value, 3),
               "vs_llamacpp_alone_paired_ci": [round(paired[name].lo, 3), round(paired[name].hi, 3)],
               "same_text_as_llamacpp_alone": sum(a == b for a, b in zip(texts[name], texts["llamacpp_alone"]))}
        for name, v in ms.items()}}
    report(result, args.out)


if __name__ == "__main__":
    main()
