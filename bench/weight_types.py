"""The served weight type, chosen by measurement: time to first token, decode speed and greedy flips per
type of the embedded target's weights, on one core of this CPU, in one run.

    taskset -c 1 python bench/weight_types.py [--repeats 3] [--flip-prompts 32] [--out FILE]

Types: the shipped Q4_1 GGUF and what `hybridspec models pull --weights` writes from it (Q4_0, Q8_0, F16).
Per type, interleaved repeat by repeat so that load drift hits every type alike, a Verifier on the
llama.cpp engine as a replica serves (one thread, prefill in chunks of `prefill_chunk`, no prefix reuse):
  ttft_s         a cold chat prompt of 538-545 tokens (bench/conversations.py: a long system prompt and a
                 question): its prefill and the first decoded token
  decode_tok_s   the 96 tokens after it, one per pass (cloud-only decoding)
  same_text      tokens of those 96 equal to the shipped Q4_1's own (a re-quantisation is another model)
  prefill_tok_s  the prompt's prefill alone (chunks of prefill_chunk), on the engine as served (ubatches
                 under 64 rows, llamacpp_context.UBATCH) and with ubatches of 2,048 rows (llama.cpp's
                 tiled kernels: faster, but a cache then depends on its chunking: docs/engine.md)
  flips          bench/llamacpp_exactness.py's count: each prompt decoded one token per pass, then that
                 decoding verified in blocks of 4, alone and eight sessions a pass; a block not accepted
                 whole with the reference's next token is a flip (what breaks hybrid == --cloud-only)
Prints one JSON object (and writes it to --out).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hybridspec.cloud.core.verifier import Verifier
from hybridspec.cloud.engine import llamacpp_context
from hybridspec.cloud.engine.base import Feed
from hybridspec.cloud.engine.llamacpp_engine import LlamaCppEngine
from hybridspec.cloud.core.limits import PrefixScope, VerifierLimits
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.gguf import GgufTarget, requantize, typed_gguf
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec
from hybridspec.distill.prompts import FREEFORM_PROMPTS
from conversations import chat
from llamacpp_exactness import BATCH, GAMMA, prompt_set, verify_blocks
from hybridspec.lab.baselines import engine_greedy
from harness import header, median, write_json

TYPES = ("Q4_1", "Q4_0", "Q8_0", "F16")
SHIPPED = "Q4_1"
NEW_TOKENS = 96


def checkpoint(target_dir: Path, workdir: Path, weights: str) -> Path:
    """The model.gguf of a checkpoint directory like the target's, serving `weights` (written from the
    shipped file), beside links to the target's tokenizer and generation config."""
    directory = workdir / weights
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                 "config.json"):
        if (target_dir / name).is_file():
            (directory / name).symlink_to(target_dir / name)
    typed = typed_gguf(directory, weights)
    if weights == SHIPPED:
        typed.symlink_to(typed_gguf(target_dir, SHIPPED))
    else:
        requantize(typed_gguf(target_dir, SHIPPED), typed, weights)
    (directory / "model.gguf").symlink_to(typed.name)
    return directory / "model.gguf"


def serve(gguf: Path, limits: VerifierLimits) -> Verifier:
    engine = LlamaCppEngine.serving(gguf, limits, 1)
    return Verifier(GgufTarget(str(gguf), gguf, engine.vocab_size), limits, engine)


def prefill_rate(engine: LlamaCppEngine, prompt: list[int], chunk: int) -> float:
    """Tokens/s of prefilling `prompt` in chunks of `chunk`, nothing scored."""
    kv = engine.new_sequence()
    start = time.perf_counter()
    for first in range(0, len(prompt), chunk):
        engine.reserve(kv, len(prompt[first:first + chunk]))
        engine.forward([Feed(kv, prompt[first:first + chunk], scored=False)])
    seconds = time.perf_counter() - start
    engine.release(kv)
    return len(prompt) / seconds


def first_token_and_decode(verifier: Verifier, prompt: list[int]) -> tuple[float, float, list[int]]:
    """(seconds to the first token, decode tokens/s after it, the tokens) of one cold session."""
    sid = f"s{time.monotonic_ns()}"
    start = time.perf_counter()
    verifier.open_session(SessionSpec(sid, tuple(prompt)))
    tokens = [verifier.verify(DraftBlock(sid, 0, len(prompt), ())).next_token]
    first = time.perf_counter()
    while len(tokens) < NEW_TOKENS:
        tokens.append(verifier.verify(DraftBlock(sid, len(tokens), len(prompt) + len(tokens), ())).next_token)
    end = time.perf_counter()
    verifier.close_session(sid)
    return first - start, (NEW_TOKENS - 1) / (end - first), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--flip-prompts", type=int, default=32)
    parser.add_argument("--flip-tokens", type=int, default=48)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    target_dir = default_paths()["target"]
    timing = VerifierLimits(max_context=2048, max_sessions=1, kv_streams=1, kv_cache_tokens=2048,
                            prefix_scope=PrefixScope.OFF, max_tree_nodes=0)
    with tempfile.TemporaryDirectory() as workdir:
        files = {weights: checkpoint(target_dir, Path(workdir), weights) for weights in TYPES}
        verifiers = {weights: serve(path, timing) for weights, path in files.items()}
        served = llamacpp_context.UBATCH
        llamacpp_context.UBATCH = 2048
        wide = {weights: LlamaCppEngine(path, 2048, 1, trees=False) for weights, path in files.items()}
        llamacpp_context.UBATCH = served
        tokenizer = verifiers[SHIPPED].target.tokenizer
        questions = FREEFORM_PROMPTS[:args.repeats]
        prompts = [chat(tokenizer, q) for q in questions]
        first_token_and_decode(verifiers[SHIPPED], prompts[0][:64])  # warm the kernels up
        rows: dict[str, dict] = {w: {"ttft_s": [], "decode_tok_s": [], "same_text": [], "prefill_tok_s": [],
                                     "prefill_tok_s_ubatch_2048": []} for w in TYPES}
        chunk = timing.prefill_chunk
        texts: dict[str, list[list[int]]] = {w: [] for w in TYPES}
        for prompt in prompts:
            for weights, verifier in verifiers.items():
                ttft, speed, tokens = first_token_and_decode(verifier, prompt)
                rows[weights]["ttft_s"].append(round(ttft, 3))
                rows[weights]["decode_tok_s"].append(round(speed, 2))
                texts[weights].append(tokens)
                rows[weights]["prefill_tok_s"].append(round(prefill_rate(verifier.engine, prompt, chunk), 1))
                rows[weights]["prefill_tok_s_ubatch_2048"].append(round(prefill_rate(wide[weights], prompt, chunk), 1))
        for weights in TYPES:
            rows[weights]["same_text"] = [sum(a == b for a, b in zip(x, y)) for x, y in zip(texts[weights],
                                                                                       texts[SHIPPED])]
        verifiers.clear()  # free the engines before the flip runs load their own
        wide.clear()
        flips = VerifierLimits(max_context=2048, max_draft=GAMMA, max_sessions=BATCH, kv_streams=BATCH,
                               kv_cache_tokens=16384)
        for weights, path in files.items():
            verifier = serve(path, flips)
            sets = prompt_set(verifier.target.tokenizer, args.flip_prompts)
            refs = [engine_greedy(verifier, p, args.flip_tokens) for p in sets]
            total = {"flips": 0, "tokens": 0}
            for batch in (1, BATCH):
                counted = verify_blocks(verifier, sets, refs, batch)
                total = {k: total[k] + counted[k] for k in total}
            rows[weights]["flips"] = total
            del verifier
    for weights, row in rows.items():
        for key in ("ttft_s", "decode_tok_s", "prefill_tok_s", "prefill_tok_s_ubatch_2048"):
            row[f"{key}_median"] = median(row[key])
    result = {**header(engine="llamacpp, 1 thread"),
              "prompt_tokens": [len(p) for p in prompts], "new_tokens": NEW_TOKENS, "types": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
