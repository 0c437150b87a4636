"""What one verify pass of a draft tree costs against a chain of as many drafted tokens, on one engine.

    python bench/tree_verify_cost.py [--engine llamacpp|torch] [--context 128] [--repeats 7] [--core 1]

The embedded target on one thread pinned to `--core`, a cached context of `--context` tokens. For n =
1, 2, 4, 8, 16, 32 drafted tokens, a pass feeds the root (the newest committed token) and either a
bushy tree of n nodes (breadth first, four children per node: a top-4 draft tree) or a chain of n;
both are n + 1 tokens. Each is timed as the fastest of `--repeats` passes, tree and chain taking turns
so load drift on the machine hits both alike. Also timed: keep_rows of the tree's first-child path
(what keeps the accepted path after a tree round; a chain round's truncate is free). An engine without
tree support (Capabilities.tree_masks false) gets its chains timed only.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridspec.cloud.core.costs import time_pass
from hybridspec.cloud.engine.base import Engine, Feed
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.protocol.tree import chain_parents, feed_parents
from harness import cpu_model, pin

SIZES = (1, 2, 4, 8, 16, 32)
BRANCHING = 4
SESSIONS = 4  # the llama.cpp engine's streams: each holds a quarter of the cache


def bushy_tree(n: int, branching: int = BRANCHING) -> list[int]:
    """Parents (common/protocol/tree.py) of n nodes added breadth first, `branching` children per node."""
    parents: list[int] = []
    frontier = [-1]
    while len(parents) < n:
        below = []
        for parent in frontier:
            for _ in range(min(branching, n - len(parents))):
                parents.append(parent)
                below.append(len(parents) - 1)
        frontier = below
    return parents


def first_child_rows(parents: list[int]) -> list[int]:
    """Fed rows of the path that always takes the first child, from the root (row 0)."""
    rows, node = [0], -1
    while children := [i for i, p in enumerate(parents) if p == node]:
        node = children[0]
        rows.append(node + 1)
    return rows


def load(kind: str, context: int) -> Engine:
    """The engine `kind` over the embedded target, one thread, with room for `context` tokens and a round."""
    target = default_paths()["target"]
    kv_tokens = SESSIONS * max(1024, context + max(SIZES) + 1)
    if kind == "llamacpp":
        from hybridspec.cloud.engine.llamacpp_engine import LlamaCppEngine
        from hybridspec.common.models.gguf import find_gguf

        return LlamaCppEngine(find_gguf(target), kv_tokens, SESSIONS, threads=1)
    from hybridspec.cloud.engine.torch_engine import engine_for
    from hybridspec.common.models.loading import load_model

    return engine_for(load_model(target, device="cpu").model, kv_tokens)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["llamacpp", "torch"], default="llamacpp")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--core", type=int, default=1 if (os.cpu_count() or 1) > 1 else 0)
    args = parser.parse_args()
    pin(args.core)
    torch.set_num_threads(1)
    engine = load(args.engine, args.context)
    trees = engine.capabilities.tree_masks
    print(f"# {args.engine} engine ({engine.capabilities.dtype}), one thread on core {args.core} of {cpu_model()}; "
          f"{args.context} cached tokens, fastest of {args.repeats}")
    if not trees:
        print("# this engine cannot score trees yet (Capabilities.tree_masks is false): chains only")
    context = [1000 + i for i in range(args.context)]
    kv = engine.new_sequence()
    engine.reserve(kv, len(context))
    engine.forward([Feed(kv, context, scored=False)])
    print("| n | chain ms | tree ms | tree / chain | keep_rows ms |")
    print("|---|---|---|---|---|")
    for n in SIZES:
        tokens = [7] + [2000 + i for i in range(n)]  # the root, then n distinct drafted tokens
        parents = bushy_tree(n)
        chain, tree, keep = [], [], []
        for _ in range(args.repeats):
            chain.append(time_pass(engine, kv, len(context), tokens, None, None)[0])
            if trees:
                ms, kept = time_pass(engine, kv, len(context), tokens, feed_parents(parents), first_child_rows(parents))
                tree.append(ms)
                keep.append(kept)
        shape = "chain" if list(parents) == list(chain_parents(n)) else "tree"
        if trees:
            print(f"| {n} | {min(chain):.1f} | {min(tree):.1f} | {min(tree) / min(chain):.2f}"
                  f"{' (a chain)' if shape == 'chain' else ''} | {min(keep):.2f} |")
        else:
            print(f"| {n} | {min(chain):.1f} | - | - | - |")
    engine.release(kv)


if __name__ == "__main__":
    main()
