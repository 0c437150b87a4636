"""Greedy flips on the llama.cpp engine: does verifying in blocks reproduce one-token decoding?

    python bench/llamacpp_exactness.py [--prompts 64] [--new-tokens 48] [--weights Q4_1 Q4_0 Q8_0 F16]

For each weight type (the shipped Q4_1 GGUF, and re-quantisations of it), on one core:
1. the reference: every prompt decoded by the engine alone, one token per pass (what --cloud-only
   streams);
2. that decoding verified in blocks of γ = 4, one session at a time ("alone") and eight sessions'
   blocks in each pass ("batched"). In exact arithmetic every block is accepted whole with the
   reference's next token as the bonus; a block that is not is a flip (a near-tie broken the other
   way by the block-shaped pass), and that prompt's comparison ends there.
Half of the prompts are chat questions (contexts well under 512 tokens), half the same questions
after a long conversation (over 512). Prints one JSON line per weight type: flips per 10^4 tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tqdm import tqdm

from hybridspec.cloud.core.verifier import Verifier
from hybridspec.cloud.engine.llamacpp_engine import LlamaCppEngine
from hybridspec.cloud.core.limits import VerifierLimits
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.gguf import GgufTarget, find_gguf, requantize
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec
from hybridspec.distill.prompts import FREEFORM_PROMPTS, heldout_prompts
from hybridspec.edge.prompt import encode_prompt
from hybridspec.lab.baselines import engine_greedy
from harness import pin, usable_cores

GAMMA = 4
BATCH = 8


def prompt_set(tokenizer, n: int) -> list[list[int]]:
    """n/2 short chat prompts, and the same after a conversation of over 512 tokens."""
    questions = (FREEFORM_PROMPTS + heldout_prompts(n))[:n // 2]
    history = " ".join(FREEFORM_PROMPTS * 3)
    short = [encode_prompt(tokenizer, q, chat=True) for q in questions]
    long = [encode_prompt(tokenizer, f"{history}\n\nNow, a new question. {q}", chat=True) for q in questions]
    assert all(len(p) > 512 for p in long)
    return short + long


def verify_blocks(verifier: Verifier, prompts: list[list[int]], refs: list[list[int]], batch: int) -> dict:
    """Verify each reference in blocks of GAMMA, `batch` sessions per pass; count the flips."""
    flips = compared = 0
    for start in range(0, len(prompts), batch):
        group = list(range(start, min(start + batch, len(prompts))))
        length = {i: verifier.open_session(SessionSpec(f"x{i}", tuple(prompts[i]))).committed_len for i in group}
        done = {i: 0 for i in group}
        live, round_index = set(group), 0
        while live:
            ready = [i for i in sorted(live) if done[i] + GAMMA + 1 <= len(refs[i])]
            live = set(ready)
            if not ready:
                break
            blocks = [DraftBlock(f"x{i}", round_index, length[i], tuple(refs[i][done[i]:done[i] + GAMMA])) for i in ready]
            for i, result in zip(ready, verifier.verify_batch(blocks)):
                compared += result.num_accepted + 1
                if result.num_accepted < GAMMA or result.next_token != refs[i][done[i] + GAMMA]:
                    flips += 1
                    live.discard(i)  # the decodings part here: what follows is not comparable
                done[i], length[i] = done[i] + GAMMA + 1, result.committed_len
            round_index += 1
        for i in group:
            verifier.close_session(f"x{i}")
    return {"flips": flips, "tokens": compared, "flips_per_10k": round(1e4 * flips / max(compared, 1), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--weights", nargs="+", default=["Q4_1", "Q4_0", "Q8_0", "F16"])
    args = parser.parse_args()
    pin(max(usable_cores()))
    shipped = find_gguf(default_paths()["target"])
    limits = VerifierLimits(max_context=2048, max_draft=GAMMA, max_sessions=BATCH, kv_cache_tokens=16384)
    with tempfile.TemporaryDirectory() as workdir:
        for weights in args.weights:
            path = shipped if weights == "Q4_1" else Path(workdir) / f"{weights}.gguf"
            if weights != "Q4_1":
                requantize(shipped, path, weights)
            engine = LlamaCppEngine(path, limits.kv_cache_tokens, limits.max_sessions, threads=1)
            verifier = Verifier(GgufTarget(str(path), path, engine.vocab_size), limits, engine)
            prompts = prompt_set(verifier.target.tokenizer, args.prompts)
            refs = [engine_greedy(verifier, p, args.new_tokens)
                    for p in tqdm(prompts, desc=f"{weights}: one token per pass", unit="prompt")]
            half = len(prompts) // 2
            row = {"weights": engine.capabilities.dtype, "prompts": len(prompts), "new_tokens": args.new_tokens}
            for name, batch in (("alone", 1), ("batched", BATCH)):
                for context, part in (("short", slice(0, half)), ("long", slice(half, None))):
                    row[f"{name}_{context}"] = verify_blocks(verifier, prompts[part], refs[part], batch)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
