"""A prefix computed once, through the default pool: chat sessions that share a long system prompt,
one at a time, with the replica's prefix cache on (the default) and off, in one run.

    python bench/prefix_reuse.py [--sessions 9] [--new-tokens 16] [--out FILE]

`cloud serve` with its defaults (a Ray pool of one replica, llama.cpp) on core 1, the client on core 0.
Each session is a `Generate` call (the cloud-only stream of the issue's measurement) of a prompt from
bench/conversations.py: the same system prompt, 525 shared tokens, a different question (538-545
tokens in all). Its time to first token is from the call to its first token; the figure is the first
session's over the median of the others (a cold prefill each, without reuse: about 1x). The servers'
Prometheus counters give the hits and tokens saved, and every session's tokens are compared between the
two servers (prefix reuse must not change a token).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time
import urllib.request

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hybridspec.cloud.process import start_cloud_process, stop_cloud_process
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.gguf import served_weights
from hybridspec.common.protocol.wire import GenerateSpec
from hybridspec.distill.prompts import FREEFORM_PROMPTS
from hybridspec.edge.client import VerifierClient
from conversations import chat
from harness import CLOUD_CORE, EDGE_CORE, header, median, pin, write_json



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def counters(port: int) -> dict[str, float]:
    """The front door's prefix-cache counters."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    wanted = ("hybridspec_prefix_cache_queries_total", "hybridspec_prefix_cache_hits_total",
              "hybridspec_prefix_cache_tokens_saved_total")
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] in wanted}


def run(prompts: list[list[int]], new_tokens: int, scope: str) -> dict:
    """The sessions one at a time against a fresh default `cloud serve` with prefix_scope `scope`."""
    metrics = free_port()
    proc, address, _ = start_cloud_process({"prefix_scope": scope, "metrics_port": metrics}, cores={CLOUD_CORE})
    ttft, tokens = [], []
    try:
        with VerifierClient(address, timeout_s=120) as client:
            for prompt in prompts:
                start = time.perf_counter()
                stream = client.generate(GenerateSpec(prompt_ids=tuple(prompt), max_new_tokens=new_tokens))
                out = [next(stream)]
                ttft.append(round(time.perf_counter() - start, 3))
                out += list(stream)
                tokens.append(out)
        time.sleep(2.5)  # one metrics refresh of the front door
        seen = counters(metrics)
    finally:
        stop_cloud_process(proc)
    rest = median(ttft[1:])
    return {"prefix_scope": scope, "ttft_s": ttft, "first_s": ttft[0], "median_rest_s": rest,
            "first_over_median_rest": round(ttft[0] / rest, 2), "counters": seen, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=9)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    pin(EDGE_CORE)
    target = default_paths()["target"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    prompts = [chat(tokenizer, q) for q in FREEFORM_PROMPTS[:args.sessions]]
    on, off = run(prompts, args.new_tokens, "identity"), run(prompts, args.new_tokens, "off")
    same = sum(a == b for a, b in zip(on.pop("tokens"), off.pop("tokens")))
    result = {**header(weights=served_weights(target)),
              "pool": "cloud serve defaults (Ray, one replica, llama.cpp, 1 thread) on core 1",
              "prompt_tokens": [len(p) for p in prompts], "new_tokens": args.new_tokens,
              "shared_prefix_tokens": min(next((i for i, (x, y) in enumerate(zip(p, prompts[0])) if x != y), len(p))
                                          for p in prompts[1:]),
              "cache_on": on, "cache_off": off, "same_tokens_on_and_off": f"{same} of {len(prompts)}"}
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
