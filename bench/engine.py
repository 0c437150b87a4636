"""What the verifier engine delivers to many edges, and whether cloud-only decoding stays honest.

    taskset -c 1 python bench/engine.py [--engine torch|llamacpp] [--sessions 8] [--steps 6] [--out FILE]

All in one run, one thread, embedded target, drafts that are the target's own greedy tokens (its
engine decoding alone: Hugging Face generate for torch, one token per pass for llama.cpp), so every
round accepts all γ = 4 drafts: the ceiling batching is measured against:
- unbatched: each session's round in a forward pass of its own; batched: all sessions' rounds in
  one step. Verified tokens/s, and their ratio.
- cloud capacity: tokens/s the replica delivers to the sessions by hybrid rounds vs by cloud-only
  decode steps (one token per session per step), both batched, and their ratio.
- the engine alone decoding the same sessions one token each per pass, with no verifier around it
  (what `llama-batched-bench` measures for llama.cpp): what the serving core costs on top.
- torch only: cloud-only Generate over a real localhost gRPC server vs the target's own Hugging Face
  `generate()`, same prompt and length, tokens/s, and whether they produce the same tokens (for
  llama.cpp that comparison, against llama-cpp-python, is bench/cloud_only_overhead.py).
"""
from __future__ import annotations

import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridspec.cloud.api.server import BackgroundServer
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.common.models.embedded import default_paths
from hybridspec.cloud.engine.base import Feed
from hybridspec.cloud.engine.factory import load_engine
from hybridspec.cloud.engine.kinds import EngineKind
from hybridspec.common.config import DType
from hybridspec.lab.baselines import engine_greedy
from hybridspec.common.protocol.wire import DraftBlock, GenerateSpec, SessionSpec
from hybridspec.distill.prompts import FREEFORM_PROMPTS
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.prompt import encode_prompt
from harness import arguments, median

GAMMA = 4
TOPICS = ["the history of the bicycle", "how bridges are built", "the life of bees", "ocean currents",
          "the invention of paper", "volcanoes", "how computers store numbers", "the seasons", "rivers",
          "the printing press", "how trains work", "the moon", "forests", "the history of music", "deserts",
          "how rain forms", "the Roman roads", "glaciers", "the telephone", "coral reefs"]


def reference(target, prompt: list[int], n: int, verifier: Verifier | None = None) -> list[int]:
    """The target's own greedy continuation: Hugging Face generate, or with `verifier` its engine alone."""
    if verifier is not None:
        return engine_greedy(verifier, prompt, n)
    out = target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def rounds_per_s(verifier: Verifier, prompts: list[list[int]], refs: list[list[int]], gamma: int,
                 steps: int, batched: bool) -> tuple[float, int]:
    """Drive every session `steps` rounds of `gamma` drafts from its reference; (tokens/s, tokens)."""
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
                raise SystemExit(f"session {i} round {r}: the target rejected its own greedy token (a near-tie)")
            tokens += result.num_accepted + 1
            done[i] += result.num_accepted + 1
            length[i] = result.committed_len
    for sid in ids:
        verifier.close_session(sid)
    return tokens / elapsed, tokens


def engine_only_per_s(verifier: Verifier, prompts: list[list[int]], steps: int) -> float:
    """Tokens/s of the bare engine decoding every session one token per pass (the scored token is
    fed back; no rules, sessions or scheduler)."""
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


def generate_per_s(target, verifier: Verifier, prompt: list[int], n: int, repeats: int) -> dict:
    """Cloud-only Generate through a localhost gRPC server vs Hugging Face generate()."""
    server = BackgroundServer(verifier)
    try:
        with VerifierClient(server.address) as client:
            ours, theirs, same = [], [], True
            for _ in range(repeats):
                t0 = time.perf_counter()
                got = list(client.generate(GenerateSpec(tuple(prompt), max_new_tokens=n)))
                ours.append(len(got) / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                want = reference(target, prompt, len(got))
                theirs.append(len(want) / (time.perf_counter() - t0))
                same &= got == want
    finally:
        server.stop()
    return {"generate_tok_s": round(median(ours), 2), "hf_generate_tok_s": round(median(theirs), 2),
            "generate_vs_hf": round(median(ours) / median(theirs), 2),
            "generate_same_tokens": same}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="rounds per session and mode")
    parser.add_argument("--dtype", default="float32", help="torch engine only")
    parser.add_argument("--engine", choices=["torch", "llamacpp"], default="torch")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    limits = VerifierLimits(max_context=4096, max_draft=GAMMA, max_sessions=4 * args.sessions,
                            kv_cache_tokens=4 * args.sessions * 2048)
    target, engine = load_engine(str(default_paths()["target"]), EngineKind(args.engine), "cpu",
                                 DType(args.dtype if args.engine == "torch" else "auto"), 1, limits)
    verifier = Verifier(target, limits, engine)
    own = verifier if args.engine == "llamacpp" else None  # whose decoding the drafts reproduce
    # Earlier questions as context, then a request for a long answer; prompts whose answer ends
    # before the rounds do are skipped.
    need = (GAMMA + 1) * args.steps
    print(f"references for {args.sessions} sessions ...", flush=True)
    prompts, refs = [], []
    for i, topic in enumerate(TOPICS):
        context = " ".join(FREEFORM_PROMPTS[(i + j) % len(FREEFORM_PROMPTS)] for j in range(8))
        prompt = encode_prompt(target.tokenizer, f"{context} Now, instead, write a long, detailed essay about "
                               f"{topic}.", chat=True)
        ref = reference(target, prompt, need, own)
        if len(ref) == need:
            prompts.append(prompt)
            refs.append(ref)
        if len(prompts) == args.sessions:
            break
    else:
        raise SystemExit(f"only {len(prompts)} prompts have {need}-token answers; use fewer --steps or --sessions")
    row: dict = {"engine": args.engine, "weights": engine.capabilities.dtype, "sessions": args.sessions, "gamma": GAMMA,
                 "prompt_tokens": [len(p) for p in prompts]}
    unbatched, _ = rounds_per_s(verifier, prompts, refs, GAMMA, args.steps, batched=False)
    batched, _ = rounds_per_s(verifier, prompts, refs, GAMMA, args.steps, batched=True)
    cloud_only, _ = rounds_per_s(verifier, prompts, refs, 0, args.steps, batched=True)
    row.update(unbatched_tok_s=round(unbatched, 2), batched_tok_s=round(batched, 2),
               batched_vs_unbatched=round(batched / unbatched, 2), cloud_only_batched_tok_s=round(cloud_only, 2),
               capacity_hybrid_vs_cloud_only=round(batched / cloud_only, 2))
    bare = engine_only_per_s(verifier, prompts, args.steps * (GAMMA + 1))
    row.update(engine_only_batched_tok_s=round(bare, 2), cloud_only_vs_engine_only=round(cloud_only / bare, 2))
    print(json.dumps(row), flush=True)
    if args.engine == "torch":
        row.update(generate_per_s(target, verifier, prompts[0], 48, repeats=3))
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
