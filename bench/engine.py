"""The verifier's engine on this machine: what a pass costs, whether a block scores exactly as its tokens
one by one, what a draft tree costs against a chain, and what batching gives many sessions.

The embedded target, one thread, as a replica serves it (--dtype: the torch engine's). A flip is a block
of γ = 4 from the engine's own one-token-per-pass decoding not accepted whole with the next token; the
first ends a prompt's comparison. docs/engine.md has the method and the numbers.
"""
from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridspec.cloud.core.costs import time_pass
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.cloud.engine.base import Feed
from hybridspec.cloud.engine.factory import load_engine
from hybridspec.cloud.engine.kinds import EngineKind
from hybridspec.common.config import DType
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.protocol.tree import chain_parents, children, feed_parents
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec
from hybridspec.distill.prompts import FREEFORM_PROMPTS
from hybridspec.edge.prompt import encode_prompt
from hybridspec.lab.baselines import engine_greedy
from harness import arguments, header, median, pass_times, report

GAMMA, FLIP_TOKENS = 4, 64  # blocks of γ = 4 over 64 tokens of each prompt's own decoding
CHAIN_SIZES = (1, 2, 3, 4, 5, 8, 9, 16, 32)
TREE_SIZES, BRANCHING = (1, 2, 4, 8, 16, 32), 4  # bushy trees: four children per node
TOPICS = ["the history of the bicycle", "how bridges are built", "the life of bees", "ocean currents",
          "the invention of paper", "volcanoes", "how computers store numbers", "the seasons", "rivers",
          "the printing press", "how trains work", "the moon", "forests", "the history of music", "deserts",
          "how rain forms", "the Roman roads", "glaciers", "the telephone", "coral reefs"]


def load(args, sessions: int = 4) -> Verifier:
    """A verifier over the embedded target on `args.engine`, one thread, a stream each for `sessions` sessions
    and as many bare sequences, and no prefix reuse (every prompt is prefilled, as the bare engine's are)."""
    limits = VerifierLimits(max_context=2048, max_draft=32, max_sessions=2 * sessions, kv_streams=2 * sessions,
                            kv_cache_tokens=2 * sessions * 2048, prefix_cache_tokens=0)
    dtype = DType(args.dtype if args.engine == "torch" else "auto")
    target, engine = load_engine(str(default_paths()["target"]), EngineKind(args.engine), "cpu", dtype, 1, limits)
    return Verifier(target, limits, engine)


def flips(verifier: Verifier, prompts: list[list[int]]) -> dict:
    """Verify the engine's own greedy decoding of each prompt in blocks of GAMMA; count the flips."""
    identical, flipped, compared = 0, 0, 0
    for i, prompt in enumerate(prompts):
        ref = engine_greedy(verifier, prompt, FLIP_TOKENS)
        sid = f"flip-{i}"
        length = verifier.open_session(SessionSpec(sid, tuple(prompt))).committed_len
        done, r = 0, 0
        while done + GAMMA + 1 <= len(ref):
            result = verifier.verify(DraftBlock(sid, r, length, tuple(ref[done:done + GAMMA])))
            compared += result.num_accepted + 1
            if result.num_accepted < GAMMA or result.next_token != ref[done + GAMMA]:
                flipped += 1
                break  # the decodings part here; what follows is no longer comparable
            done, r, length = done + GAMMA + 1, r + 1, result.committed_len
        else:
            identical += 1
        verifier.close_session(sid)
    return {"generations": len(prompts), "identical": identical, "flips": flipped, "tokens_compared": compared}


def chain(verifier: Verifier, args) -> dict:
    """t(M) for every M in CHAIN_SIZES, v, and the flips."""
    context = [100 + i for i in range(args.context)]
    for m in CHAIN_SIZES:  # warm-up: the first passes of each size pay one-time costs
        pass_times(verifier.engine, context, context[-m:], 1)
    t = {m: median(pass_times(verifier.engine, context, context[-m:], args.repeats)) for m in CHAIN_SIZES}
    prompts = [encode_prompt(verifier.target.tokenizer, p, chat=True) for p in FREEFORM_PROMPTS[:args.prompts]]
    return {"t_ms": {m: round(ms, 2) for m, ms in t.items()}, "v_gamma4": round(t[GAMMA + 1] / t[1], 2),
            "context": args.context, "repeats": args.repeats, **flips(verifier, prompts)}


def bushy_tree(n: int) -> list[int]:
    """Parents (common/protocol/tree.py) of n nodes added breadth first, BRANCHING children per node."""
    return [i // BRANCHING - 1 for i in range(n)]


def first_child_rows(parents: list[int]) -> list[int]:
    """Fed rows of the path that always takes the first child, from the root (row 0)."""
    kids, rows = children(parents), [0]  # kids[row]: the children of the node fed at that row
    while kids[rows[-1]]:
        rows.append(kids[rows[-1]][0] + 1)
    return rows


def tree(verifier: Verifier, args) -> dict:
    """Tree and chain passes of n drafted tokens, in turns; the fastest of each."""
    engine = verifier.engine
    trees = engine.capabilities.tree_masks
    context = [1000 + i for i in range(args.context)]
    kv = engine.new_sequence()
    engine.reserve(kv, len(context))
    engine.forward([Feed(kv, context, scored=False)])
    rows = []
    for n in TREE_SIZES:
        tokens = [7] + [2000 + i for i in range(n)]  # the root, then n distinct drafted tokens
        parents = bushy_tree(n)
        chain_ms, tree_ms, keep_ms = [], [], []
        for _ in range(args.repeats):
            chain_ms.append(time_pass(engine, kv, len(context), tokens)[0])
            if trees:
                ms, kept = time_pass(engine, kv, len(context), tokens, feed_parents(parents), first_child_rows(parents))
                tree_ms.append(ms)
                keep_ms.append(kept)
        row = {"nodes": n, "chain_ms": round(min(chain_ms), 2), "is_chain": parents == list(chain_parents(n))}
        if trees:
            row.update(tree_ms=round(min(tree_ms), 2), tree_vs_chain=round(min(tree_ms) / min(chain_ms), 3),
                       keep_rows_ms=round(min(keep_ms), 3))
        rows.append(row)
        print(row, flush=True)
    engine.release(kv)
    return {"context": args.context, "repeats": args.repeats, "trees": trees, "rows": rows}


def rounds_per_s(verifier: Verifier, prompts: list[list[int]], refs: list[list[int]], gamma: int, steps: int,
                 batched: bool) -> float:
    """Drive every session `steps` rounds of `gamma` drafts from its reference; verified tokens/s."""
    ids = [f"{'b' if batched else 'u'}{gamma}-{i}" for i in range(len(prompts))]
    length = [verifier.open_session(SessionSpec(sid, tuple(p))).committed_len for sid, p in zip(ids, prompts)]
    done = [0] * len(prompts)
    tokens, elapsed = 0, 0.0
    for r in range(steps):
        blocks = [DraftBlock(sid, r, length[i], tuple(refs[i][done[i]:done[i] + gamma])) for i, sid in enumerate(ids)]
        t0 = time.perf_counter()
        results = verifier.verify_batch(blocks) if batched else [verifier.verify(b) for b in blocks]
        elapsed += time.perf_counter() - t0
        for i, result in enumerate(results):
            if result.num_accepted < len(blocks[i].draft_ids):
                raise SystemExit(f"session {i} round {r}: the engine rejected its own greedy token (a flip)")
            tokens += result.num_accepted + 1
            done[i] += result.num_accepted + 1
            length[i] = result.committed_len
    for sid in ids:
        verifier.close_session(sid)
    return tokens / elapsed


def engine_only_per_s(verifier: Verifier, prompts: list[list[int]], steps: int) -> float:
    """Tokens/s of the bare engine decoding every session one token per pass (no rules or sessions)."""
    engine = verifier.engine
    seqs = [engine.new_sequence() for _ in prompts]
    for kv, prompt in zip(seqs, prompts):
        engine.reserve(kv, len(prompt))
        engine.forward([Feed(kv, prompt[:-1], scored=False)])
    last = [p[-1] for p in prompts]
    t0 = time.perf_counter()
    for _ in range(steps):
        for kv in seqs:
            engine.reserve(kv, 1)
        scores = engine.forward([Feed(kv, [token], scored=True) for kv, token in zip(seqs, last)])
        last = [int(s.logits[-1].argmax()) for s in scores]
    elapsed = time.perf_counter() - t0
    for kv in seqs:
        engine.release(kv)
    return steps * len(prompts) / elapsed


def batch(verifier: Verifier, args) -> dict:
    """Batched against unbatched verify rounds, hybrid against cloud-only capacity, and the bare engine."""
    need = (GAMMA + 1) * args.steps
    prompts, refs = [], []
    for i, topic in enumerate(TOPICS):  # earlier questions as context, then a request for a long answer
        context = " ".join(FREEFORM_PROMPTS[(i + j) % len(FREEFORM_PROMPTS)] for j in range(8))
        prompt = encode_prompt(verifier.target.tokenizer, f"{context} Now, instead, write a long, detailed essay "
                               f"about {topic}.", chat=True)
        ref = engine_greedy(verifier, prompt, need)
        if len(ref) == need:  # answers that end before the rounds do are skipped
            prompts.append(prompt)
            refs.append(ref)
        if len(prompts) == args.sessions:
            break
    else:
        raise SystemExit(f"only {len(prompts)} prompts have {need}-token answers; use fewer --steps or --sessions")
    unbatched = rounds_per_s(verifier, prompts, refs, GAMMA, args.steps, batched=False)
    batched = rounds_per_s(verifier, prompts, refs, GAMMA, args.steps, batched=True)
    cloud_only = rounds_per_s(verifier, prompts, refs, 0, args.steps, batched=True)
    bare = engine_only_per_s(verifier, prompts, need)
    return {"sessions": args.sessions, "gamma": GAMMA, "prompt_tokens": [len(p) for p in prompts],
            "unbatched_tok_s": round(unbatched, 2), "batched_tok_s": round(batched, 2),
            "batched_vs_unbatched": round(batched / unbatched, 2), "cloud_only_batched_tok_s": round(cloud_only, 2),
            "capacity_hybrid_vs_cloud_only": round(batched / cloud_only, 2), "engine_only_batched_tok_s": round(bare, 2),
            "cloud_only_vs_engine_only": round(cloud_only / bare, 2)}


def main() -> None:
    parser = arguments(__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    chain_ = commands.add_parser("chain", help="t(M) for M = 1..32, v, and greedy flips")
    chain_.add_argument("--context", type=int, default=200)
    chain_.add_argument("--repeats", type=int, default=5)
    chain_.add_argument("--prompts", type=int, default=8)
    tree_ = commands.add_parser("tree", help="a bushy draft tree against a chain of as many tokens")
    tree_.add_argument("--context", type=int, default=128)
    tree_.add_argument("--repeats", type=int, default=7)
    batch_ = commands.add_parser("batch", help="many sessions' rounds batched against one per pass")
    batch_.add_argument("--sessions", type=int, default=8)
    batch_.add_argument("--steps", type=int, default=6, help="rounds per session and mode")
    for command in (chain_, tree_, batch_):
        command.add_argument("--engine", choices=["llamacpp", "torch"], default="llamacpp")
        command.add_argument("--dtype", default="float32", help="the torch engine's dtype")
        command.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    verifier = load(args, getattr(args, "sessions", 4))
    result = {"chain": chain, "tree": tree, "batch": batch}[args.command](verifier, args)
    report({**header(engine=f"{args.engine}, 1 thread", weights=verifier.engine.capabilities.dtype), **result},
           args.out)


if __name__ == "__main__":
    main()
