"""What a verify pass costs: a chain against one decoded token per dtype (and how often bf16 flips a
token), and a draft tree against a chain of as many drafted tokens.

    taskset -c 1 python bench/verify_cost.py chain [--dtypes float32 bfloat16] [--context 200] [--repeats 12] [--prompts 8]
    python bench/verify_cost.py tree [--engine llamacpp|torch] [--context 128] [--repeats 7] [--core 1]

chain, on the verifier core (embedded target, one torch thread, as a replica runs it):
- t(n): one engine step of n scored tokens after a cached context of `--context` tokens (median of
  repeats); v = t(γ+1) / t(1) at γ = 4 is what a round costs in target-token times (docs/design.md
  §2). hf_t(n) is the same forward through Hugging Face's own cache, for comparison.
- exactness in the served dtype: every prompt is decoded by the target alone (Hugging Face greedy,
  one token per step) and then verified in blocks of γ = 4 drafted from exactly that decoding. In
  exact arithmetic every block is accepted; a rejection is a near-tie that the block-shaped forward
  pass broke the other way. Reported: generations identical to the target's own, and flips per token.
Prints a JSON row per dtype.

tree: the embedded target on one thread pinned to `--core`, a cached context of `--context` tokens. For
n = 1, 2, 4, 8, 16, 32 drafted tokens, a pass feeds the root (the newest committed token) and either a
bushy tree of n nodes (breadth first, four children per node: a top-4 draft tree) or a chain of n;
both are n + 1 tokens. Each is timed as the fastest of `--repeats` passes, tree and chain taking turns
so load drift on the machine hits both alike. Also timed: keep_rows of the tree's first-child path
(what keeps the accepted path after a tree round; a chain round's truncate is free). An engine without
tree support (Capabilities.tree_masks false) gets its chains timed only. Prints a Markdown table.
"""
from __future__ import annotations

import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import DynamicCache

from hybridspec.cloud.core.costs import time_pass
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.cloud.engine.base import Engine, Feed
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.loading import load_model
from hybridspec.common.protocol.tree import chain_parents, feed_parents
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec
from hybridspec.distill.prompts import FREEFORM_PROMPTS
from hybridspec.edge.prompt import encode_prompt
from harness import arguments, cpu_model, median, pin, references

GAMMA = 4
NEW_TOKENS = 64
SIZES = (1, 2, 4, 8, 16, 32)
BRANCHING = 4
SESSIONS = 4  # the llama.cpp engine's streams: each holds a quarter of the cache


@torch.inference_mode()
def forward_ms(engine: Engine, model, context: list[int], n: int, repeats: int) -> tuple[float, float]:
    """Median times of feeding n scored tokens after `context`: (engine step, Hugging Face forward
    with its DynamicCache). The two alternate, so drifting load on the machine hits both alike."""
    kv = engine.new_sequence()
    engine.reserve(kv, len(context))
    engine.forward([Feed(kv, context, scored=False)])
    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(time_pass(engine, kv, len(context), context[-n:])[0])
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([context]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        t0 = time.perf_counter()
        model(input_ids=torch.tensor([context[-n:]]), past_key_values=cache, use_cache=True)
        theirs.append((time.perf_counter() - t0) * 1e3)
    engine.release(kv)
    return median(ours), median(theirs)


def flips(verifier: Verifier, prompts: list[list[int]]) -> dict:
    """Verify the target's own greedy decoding in blocks of GAMMA; count rejected blocks."""
    target = verifier.target
    identical, flipped, compared = 0, 0, 0
    for i, prompt in enumerate(prompts):
        ref = references(target, [prompt], NEW_TOKENS)[0]
        sid = f"flip-{i}"
        length = verifier.open_session(SessionSpec(sid, tuple(prompt))).committed_len
        done, r, same = 0, 0, True
        while done + GAMMA + 1 <= len(ref):
            result = verifier.verify(DraftBlock(sid, r, length, tuple(ref[done:done + GAMMA])))
            compared += result.num_accepted + 1
            if result.num_accepted < GAMMA or result.next_token != ref[done + GAMMA]:
                flipped += 1
                same = False
                break  # the decodings part here; what follows is no longer comparable
            done, r, length = done + GAMMA + 1, r + 1, result.committed_len
        verifier.close_session(sid)
        identical += same
    return {"generations": len(prompts), "identical": identical, "flips": flipped, "tokens_compared": compared}


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

    return engine_for(load_model(target, device="cpu").model, kv_tokens)


def chain(args) -> None:
    """t(n), v and the flips per dtype, a JSON row each."""
    path = default_paths()["target"]
    for dtype in args.dtypes:
        target = load_model(path, device="cpu", dtype=dtype)
        verifier = Verifier(target, VerifierLimits(max_context=2048, max_draft=GAMMA, kv_cache_tokens=8192))
        context = list(range(100, 100 + args.context))
        sizes = (1, GAMMA + 1, 2 * GAMMA + 1)
        both = {n: forward_ms(verifier.engine, target.model, context, n, args.repeats) for n in sizes}
        t = {n: ours for n, (ours, _) in both.items()}
        hf = {n: theirs for n, (_, theirs) in both.items()}
        prompts = [encode_prompt(target.tokenizer, p, chat=True) for p in FREEFORM_PROMPTS[:args.prompts]]
        row = {"dtype": dtype, **{f"t{n}_ms": round(v, 1) for n, v in t.items()},
               "v_gamma4": round(t[GAMMA + 1] / t[1], 2),
               **{f"hf_t{n}_ms": round(v, 1) for n, v in hf.items()},
               "hf_v_gamma4": round(hf[GAMMA + 1] / hf[1], 2), **flips(verifier, prompts)}
        print(json.dumps(row), flush=True)


@torch.inference_mode()
def tree(args) -> None:
    """Tree and chain passes of n = 1..32 drafted tokens, a Markdown table."""
    pin(args.core)
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
        chain_ms, tree_ms, keep_ms = [], [], []
        for _ in range(args.repeats):
            chain_ms.append(time_pass(engine, kv, len(context), tokens, None, None)[0])
            if trees:
                ms, kept = time_pass(engine, kv, len(context), tokens, feed_parents(parents), first_child_rows(parents))
                tree_ms.append(ms)
                keep_ms.append(kept)
        shape = "chain" if list(parents) == list(chain_parents(n)) else "tree"
        if trees:
            print(f"| {n} | {min(chain_ms):.1f} | {min(tree_ms):.1f} | {min(tree_ms) / min(chain_ms):.2f}"
                  f"{' (a chain)' if shape == 'chain' else ''} | {min(keep_ms):.2f} |")
        else:
            print(f"| {n} | {min(chain_ms):.1f} | - | - | - |")
    engine.release(kv)


def main() -> None:
    parser = arguments(__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    dtypes = commands.add_parser("chain", help="chains per dtype against one token, and bf16's flips")
    dtypes.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    dtypes.add_argument("--context", type=int, default=200)
    dtypes.add_argument("--repeats", type=int, default=12)
    dtypes.add_argument("--prompts", type=int, default=8)
    trees = commands.add_parser("tree", help="a bushy draft tree against a chain of as many tokens")
    trees.add_argument("--engine", choices=["llamacpp", "torch"], default="llamacpp")
    trees.add_argument("--context", type=int, default=128)
    trees.add_argument("--repeats", type=int, default=7)
    trees.add_argument("--core", type=int, default=1 if (os.cpu_count() or 1) > 1 else 0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    chain(args) if args.command == "chain" else tree(args)


if __name__ == "__main__":
    main()
