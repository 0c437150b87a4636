"""What a verify round costs relative to one decoded token, per dtype, and how often bf16 flips a token.

    python bench/verify_cost.py [--dtypes float32 bfloat16] [--context 200] [--repeats 12] [--prompts 8]

On the verifier core (embedded target, one torch thread, as a replica runs it):
- t(n): one engine step of n scored tokens after a cached context of `--context` tokens (median of
  repeats); v = t(γ+1) / t(1) at γ = 4 is what a round costs in target-token times (docs/design.md
  §2). hf_t(n) is the same forward through Hugging Face's own cache, for comparison.
- exactness in the served dtype: every prompt is decoded by the target alone (Hugging Face greedy,
  one token per step) and then verified in blocks of γ = 4 drafted from exactly that decoding. In
  exact arithmetic every block is accepted; a rejection is a near-tie that the block-shaped forward
  pass broke the other way. Reported: generations identical to the target's own, and flips per token.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import DynamicCache

from hybridspec.cloud.core.costs import time_pass
from hybridspec.cloud.engine.base import Engine, Feed
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.loading import load_model
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec
from hybridspec.distill.prompts import FREEFORM_PROMPTS
from hybridspec.edge.prompt import encode_prompt
from harness import median

GAMMA = 4
NEW_TOKENS = 64


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
        ref = target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
        ref = ref.tolist()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
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


if __name__ == "__main__":
    main()
