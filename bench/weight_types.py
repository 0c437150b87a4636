"""The served weight type, chosen by measurement: time to first token, decode speed and greedy flips per
type of the embedded target's weights, on one core of this CPU, in one run.

    taskset -c 1 python bench/weight_types.py [--repeats 3] [--flip-prompts 32] [--out FILE]
    taskset -c 1 python bench/weight_types.py --flips-only [--flip-prompts 64] [--flip-tokens 48] [--out FILE.jsonl]

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
  flips          each prompt (half chat questions, half the same after a conversation of over 512
                 tokens) decoded one token per pass (what --cloud-only streams), then that decoding
                 verified in blocks of γ = 4, one session a pass ("alone") and eight ("batched"). In exact
                 arithmetic every block is accepted whole with the reference's next token; a block that
                 is not is a flip (a near-tie broken the other way by the block-shaped pass: what breaks
                 hybrid == --cloud-only), and that prompt's comparison ends there.
Prints one JSON object (and writes it to --out). With --flips-only it measures the flips alone, per
type a JSON line of them split alone/batched and short/long contexts (flips per 10^4 tokens).
"""
from __future__ import annotations

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
from hybridspec.distill.prompts import FREEFORM_PROMPTS, heldout_prompts
from hybridspec.edge.prompt import encode_prompt
from hybridspec.lab.baselines import engine_greedy
from conversations import chat
from harness import arguments, header, median, report

TYPES = ("Q4_1", "Q4_0", "Q8_0", "F16")
SHIPPED = "Q4_1"
NEW_TOKENS = 96
GAMMA = 4
BATCH = 8


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


def flips(path: Path, prompts: int, new_tokens: int) -> dict:
    """Flips of the type served from `path`, split alone/batched and short/long contexts."""
    limits = VerifierLimits(max_context=2048, max_draft=GAMMA, max_sessions=BATCH, kv_streams=BATCH,
                            kv_cache_tokens=16384)
    verifier = serve(path, limits)
    sets = prompt_set(verifier.target.tokenizer, prompts)
    refs = [engine_greedy(verifier, p, new_tokens) for p in sets]
    half = len(sets) // 2
    return {f"{name}_{context}": verify_blocks(verifier, sets[part], refs[part], batch)
            for name, batch in (("alone", 1), ("batched", BATCH))
            for context, part in (("short", slice(0, half)), ("long", slice(half, None)))}


def flips_only(args) -> None:
    """Per type a JSON line of its flips (written to --out as JSON lines)."""
    lines = []
    with tempfile.TemporaryDirectory() as workdir:
        for weights in TYPES:
            row = {"weights": weights, "prompts": args.flip_prompts, "new_tokens": args.flip_tokens,
                   **flips(checkpoint(default_paths()["target"], Path(workdir), weights), args.flip_prompts,
                           args.flip_tokens)}
            lines.append(json.dumps(row))
            print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--flip-prompts", type=int, default=32)
    parser.add_argument("--flip-tokens", type=int, default=48)
    parser.add_argument("--flips-only", action="store_true", help="only the flips, split by batch and context")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.flips_only:
        return flips_only(args)
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
        for weights, path in files.items():
            counted = flips(path, args.flip_prompts, args.flip_tokens).values()
            rows[weights]["flips"] = {k: sum(c[k] for c in counted) for k in ("flips", "tokens")}
    for weights, row in rows.items():
        for key in ("ttft_s", "decode_tok_s", "prefill_tok_s", "prefill_tok_s_ubatch_2048"):
            row[f"{key}_median"] = median(row[key])
    result = {**header(engine="llamacpp, 1 thread"),
              "prompt_tokens": [len(p) for p in prompts], "new_tokens": NEW_TOKENS, "types": rows}
    report(result, args.out)


if __name__ == "__main__":
    main()
