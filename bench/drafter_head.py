"""Widening the plain drafter's head without retraining: coverage, agreement and drafting cost per head size.

    taskset -c 1 python bench/drafter_head.py [--choose-prompts 96] [--choose-tokens 64]
        [--sizes 8192,12288,16384,24576,32768,49152] [--eval-prompts 8] [--eval-tokens 96]
        [--rounds 3] [--repeats 9] [--out docs/drafter/head_size.json]

The plain drafter predicts over `head_ids`, 8,192 rows of the target's tied output head, so a wider
head is just more rows of the same matrix and needs no training to try. Rows are chosen from the
target's own outputs on prompts disjoint from the evaluation set (nested heads; a second ranking puts
"rogue" rows, which would win the first choice more often wrongly than rightly, last). Per head size:
coverage, the drafter's top-1/top-4 agreement (torch, and α again on the converted llama.cpp variant),
and c = the llama.cpp drafter's ms per drafted token / the llama.cpp target's ms per token, one thread,
the fastest of `--rounds` rounds. The method in full: docs/drafter/head_size.md.
Prints a table; --out writes the numbers as JSON.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hybridspec.cloud.engine.base import Feed
from hybridspec.cloud.engine.llamacpp_engine import LlamaCppEngine
from hybridspec.common.models.drafter_gguf import GGUF_NAME, convert_drafter, find_converted
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.gguf import find_gguf
from hybridspec.common.models.loading import LoadedModel, load_model
from hybridspec.common.models.manifest import MANIFEST, WEIGHTS
from hybridspec.common.protocol.wire import SamplingParams
from hybridspec.distill.data import self_instruct_requests
from hybridspec.distill.prompts import FREEFORM_PROMPTS
from hybridspec.edge.drafter import ModelDrafter
from hybridspec.edge.llamacpp_lm import LlamaCppLM
from hybridspec.edge.prompt import encode_prompt
from hybridspec.edge.proposal import DraftSettings, Drafting
from llamacpp_drafter import time_drafters
from harness import arguments, cpu_model, median, pass_times, references, usable_cores, write_json

SIZES = (8192, 12288, 16384, 24576, 32768, 49152)
TOP_K = 4
COVERAGE_GOAL = 0.995
C_GOAL = 0.08


def busy() -> list[str]:
    """Other benchmark or test processes sharing the cores (timings are then taken under load)."""
    out = subprocess.run(["pgrep", "-af", "experiment run|pytest"], capture_output=True, text=True).stdout
    return [line[:60] for line in out.splitlines() if str(os.getpid()) != line.split(" ", 1)[0]]


# ---------------------------------------------------------------------------------------------- choosing rows

def choice_prompts(target: LoadedModel, count: int, seed: int, evaluation: list[str]) -> tuple[list[str], dict]:
    """`count` free-form prompts disjoint from `evaluation`: FREEFORM_PROMPTS after the evaluation's, then
    self-instruct requests written by the target."""
    banned = {q.strip().lower() for q in evaluation}
    freeform = [q for q in FREEFORM_PROMPTS if q.strip().lower() not in banned][:count]
    want = count - len(freeform)
    requests: list[str] = []
    asked = 0
    while want > 0 and len(requests) < want and asked < 4 * want:
        batch = max(16, int(1.3 * (want - len(requests))))
        written = self_instruct_requests(target, batch, batch_size=16, seed=seed + asked)
        asked += batch
        for r in written:
            if r.strip().lower() not in banned and r not in requests:
                requests.append(r)
    prompts = freeform + requests[:max(0, want)]
    return prompts, {"freeform": len(freeform), "self_instruct": len(prompts) - len(freeform)}


def llama_outputs(engine: LlamaCppEngine, prompts: list[list[int]], tokens: int, eos: set[int],
                  ) -> tuple[list[list[int]], torch.Tensor]:
    """The llama.cpp target's greedy continuations (ending at an end-of-sequence id) and its summed
    next-token probabilities over every generated position."""
    mass = torch.zeros(engine.vocab_size, dtype=torch.float64)
    texts = []
    for prompt in prompts:
        kv, feed, text = engine.new_sequence(), prompt, []
        while len(text) < tokens:
            engine.reserve(kv, len(feed))
            logits = engine.forward([Feed(kv, feed, scored=True)])[0].logits[-1].float()
            mass += torch.softmax(logits.double(), dim=-1)
            token = int(logits.argmax())
            text.append(token)
            feed = [token]
            if token in eos:
                break
        engine.release(kv)
        texts.append(text)
    return texts, mass


def ranking(base: torch.Tensor, counts: torch.Tensor, mass: torch.Tensor, tiebreak: str) -> torch.Tensor:
    """Every id outside `base`, best first: by count, then (tiebreak "mass") summed probability, then id."""
    vocab = counts.numel()
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[base] = False
    ids = torch.nonzero(outside).flatten().numpy()
    keys = [ids, -counts.numpy()[ids]]  # np.lexsort: the last key is the primary one
    if tiebreak == "mass":
        keys.insert(1, -mass.numpy()[ids])
    order = ids[np.lexsort(keys)]
    return torch.from_numpy(order.astype(np.int64))


# ------------------------------------------------------------------------------------------------ agreement

@torch.inference_mode()
def prompt_logits(drafter: LoadedModel, prompts: list[list[int]], texts: list[list[int]]):
    """Per prompt, the drafter's logits over the whole vocabulary at every continuation position
    [len(text), V]: its final (normed) hidden state @ the target's tied embedding matrix, one
    teacher-forced pass a prompt (what its incremental feeds compute, up to rounding)."""
    model = drafter.model
    weight = model.get_input_embeddings().weight.float()
    # The shipped head is exactly these rows of the same matrix (a check that the tie holds).
    assert torch.equal(model.lm_head.weight.float(), weight[drafter.head_ids.cpu()])
    for prompt, text in zip(prompts, texts):
        ids = torch.tensor([prompt + text[:-1]])
        hidden = model.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1:].float()
        yield hidden @ weight.T


def drafter_logits(drafter: LoadedModel, prompts: list[list[int]], texts: list[list[int]]) -> torch.Tensor:
    """prompt_logits for every prompt, concatenated: [positions, V]."""
    return torch.cat(list(prompt_logits(drafter, prompts, texts)))


def row_verdicts(drafter: LoadedModel, prompts: list[list[int]], texts: list[list[int]], base: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """On the choosing set, per row outside `base`: at how many positions adding it alone to today's head
    would make it the drafter's first choice wrongly (steals) and rightly (wins)."""
    vocab = drafter.vocab_size
    steals = torch.zeros(vocab, dtype=torch.long)
    wins = torch.zeros(vocab, dtype=torch.long)
    for logits, text in zip(prompt_logits(drafter, prompts, texts), texts):
        above = logits > logits[:, base].max(dim=-1, keepdim=True).values
        above[:, base] = False
        right = torch.zeros_like(above)
        right[torch.arange(len(text)), torch.tensor(text)] = True
        wins += (above & right).sum(dim=0)
        steals += (above & ~right).sum(dim=0)
    return steals, wins


def head_agreement(logits: torch.Tensor, targets: torch.Tensor, head: torch.Tensor, base_top1: torch.Tensor | None,
                   base_head: torch.Tensor) -> dict:
    """Coverage and the drafter's top-1/top-K agreement with `targets` when it predicts over `head` only."""
    mask = torch.full((logits.shape[1],), float("-inf"))
    mask[head] = 0.0
    top = (logits + mask).topk(TOP_K, dim=-1).indices
    top1 = top[:, 0] == targets
    inside = torch.zeros(logits.shape[1], dtype=torch.bool)
    inside[head] = True
    in_base = torch.zeros(logits.shape[1], dtype=torch.bool)
    in_base[base_head] = True
    covered = inside[targets]
    new = covered & ~in_base[targets]  # the target's token is in this head but not in today's
    out = {"coverage": round(covered.float().mean().item(), 4), "alpha": round(top1.float().mean().item(), 4),
           f"top{TOP_K}": round((top == targets[:, None]).any(dim=-1).float().mean().item(), 4),
           "newly_covered": int(new.sum()), "newly_covered_top1": int((top1 & new).sum()),
           f"newly_covered_top{TOP_K}": int(((top == targets[:, None]).any(dim=-1) & new).sum()),
           "top1_outside_8192": int((~in_base[top[:, 0]]).sum())}
    if base_top1 is not None:
        out["gained_vs_8192"] = int((top1 & ~base_top1).sum())
        out["lost_vs_8192"] = int((~top1 & base_top1).sum())
    return out


@torch.inference_mode()
def llama_alpha(files, head: torch.Tensor, vocab: int, prompts: list[list[int]], texts: list[list[int]]) -> float:
    """The llama.cpp drafter's greedy agreement with the target's tokens (its own incremental feeds)."""
    hits = positions = 0
    for prompt, text in zip(prompts, texts):
        lm = LlamaCppLM.open(files, head, vocab)
        logits = lm.advance(prompt)
        for token in text:
            hits += int(logits.argmax()) == token
            positions += 1
            logits = lm.feed([token])
    return round(hits / positions, 4)


# ----------------------------------------------------------------------------------------------------- cost

def variant(source: Path, head: torch.Tensor, out: Path, weights: str) -> tuple[object, float, float]:
    """The shipped drafter with `head` as its head_ids, converted to a GGUF under `out`:
    (LlamaDraftFiles, conversion seconds, GGUF MiB)."""
    out.mkdir(parents=True)
    shutil.copy(source / MANIFEST, out / MANIFEST)
    with safe_open(source / WEIGHTS, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["head_ids"] = head.sort().values.to(torch.int32).contiguous()
    save_file(tensors, out / WEIGHTS)
    t0 = time.perf_counter()
    convert_drafter(out, weights, log=lambda _: None)
    seconds = time.perf_counter() - t0
    files = find_converted(out, threads=1)
    assert files is not None and files.head_rows == head.numel()
    return files, seconds, (out / GGUF_NAME).stat().st_size / 2**20


@torch.inference_mode()
def timing_round(drafters: dict[int, LoadedModel], engine: LlamaCppEngine, context_len: int, block: int,
                 repeats: int) -> dict:
    """One round: every variant's per-token drafting and feed ms (medians of `repeats`, variants
    alternating), and the target's one-token pass."""
    settings = DraftSettings(sampling=SamplingParams(temperature=0.0), vocab_size=engine.vocab_size,
                             stop_ids=frozenset(), drafting=Drafting(fallback_threshold=0.0))
    context = list(range(1000, 1000 + context_len))
    runs = {rows: ModelDrafter(d, settings, LlamaCppLM.open(d.llama, d.head_ids, engine.vocab_size))
            for rows, d in drafters.items()}
    drafting = time_drafters(runs, context, block, repeats)
    target = median(pass_times(engine, context, context[:1], 4 * repeats))
    return {"target_ms": round(target, 3), "drafters": drafting}


def fit(rows: list[int], ms: list[float]) -> dict:
    """feed ms = layers + per_1k_rows * rows / 1000, least squares."""
    slope, intercept = np.polyfit(np.asarray(rows, dtype=float) / 1000, np.asarray(ms), 1)
    return {"layers_ms": round(float(intercept), 3), "per_1k_rows_ms": round(float(slope), 4)}


# ----------------------------------------------------------------------------------------------------- main

def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--choose-prompts", type=int, default=96, help="prompts whose outputs choose the rows")
    parser.add_argument("--choose-tokens", type=int, default=64, help="target tokens per choosing prompt")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="head rows, comma-separated")
    parser.add_argument("--tiebreak", choices=("mass", "id"), default="mass",
                        help="rank tokens the target never emitted by its summed probability, or by id")
    parser.add_argument("--eval-prompts", type=int, default=8, help="free-form prompts, from the first")
    parser.add_argument("--eval-tokens", type=int, default=96)
    parser.add_argument("--weights", default="Q8_0", help="the variants' GGUF weight type (shipped: Q8_0)")
    parser.add_argument("--context", type=int, default=200, help="cached tokens before a timed block")
    parser.add_argument("--block", type=int, default=8, help="tokens per timed greedy block")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds; the fastest is reported")
    parser.add_argument("--repeats", type=int, default=9, help="timings per variant per round (median)")
    parser.add_argument("--seed", type=int, default=1, help="self-instruct requests' seed")
    parser.add_argument("--out", type=Path, default=None, help="write the numbers here as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    started = time.perf_counter()
    load_before = busy()
    paths = default_paths()
    target = load_model(paths["target"], device="cpu", engine="torch")
    drafter = load_model(paths["plain"], device="cpu", engine="torch")
    vocab, eos = drafter.vocab_size, set(target.eos_token_ids)
    base = drafter.head_ids.cpu().long()
    sizes = [s for s in sizes if base.numel() <= s <= vocab]
    engine = LlamaCppEngine(find_gguf(paths["target"]), 4096, 1, threads=1)
    log = lambda text: print(f"[{time.perf_counter() - started:6.1f}s] {text}", flush=True)  # noqa: E731

    # 1. Rows, from prompts the evaluation never sees.
    evaluation = FREEFORM_PROMPTS[:args.eval_prompts]
    questions, sources = choice_prompts(target, args.choose_prompts, args.seed, evaluation)
    log(f"{len(questions)} choosing prompts ({sources})")
    choose = [encode_prompt(target.tokenizer, q, chat=True) for q in questions]
    choose_texts, mass = llama_outputs(engine, choose, args.choose_tokens, eos)
    choose_tokens = torch.tensor([t for text in choose_texts for t in text])
    counts = torch.bincount(choose_tokens, minlength=vocab)
    order = ranking(base, counts, mass, args.tiebreak)
    heads = {n: torch.cat([base, order[:n - base.numel()]]) for n in sizes}
    seen_outside = int(((counts > 0).sum() - (counts[base] > 0).sum()).item())
    log(f"{choose_tokens.numel()} target tokens; {seen_outside} distinct ids outside today's head")
    # The same ranking with "rogue" rows last: rows that, added alone, would become the drafter's
    # first choice on the choosing set more often wrongly than rightly (the drafter never learnt to
    # keep its hidden state away from rows outside its head). Same sizes, so the same cost.
    steals, wins = row_verdicts(drafter, choose, choose_texts, base)
    rogue = steals[order] > wins[order]
    order_safe = torch.cat([order[~rogue], order[rogue]])
    heads_safe = {n: torch.cat([base, order_safe[:n - base.numel()]]) for n in sizes}
    worst = order[rogue][steals[order[rogue]].argsort(descending=True)][:10].tolist()
    rogues = {"rows": int(rogue.sum()), "positions": int(choose_tokens.numel()),
              "worst": [{"id": t, "text": target.tokenizer.decode([t]), "steals": int(steals[t]), "wins": int(wins[t])}
                        for t in worst]}
    log(f"{rogues['rows']} rogue rows; worst {rogues['worst'][:3]}")

    # 2. Agreement on the evaluation set.
    prompts = [encode_prompt(target.tokenizer, q, chat=True) for q in evaluation]
    texts = references(target, prompts, args.eval_tokens)
    targets = torch.tensor([t for text in texts for t in text])
    logits = drafter_logits(drafter, prompts, texts)
    log(f"{targets.numel()} evaluation positions")
    agreement: dict[int, dict] = {}
    mask = torch.full((vocab,), float("-inf"))
    mask[base] = 0.0
    base_top1 = (logits + mask).argmax(dim=-1) == targets
    for n in sizes:
        agreement[n] = head_agreement(logits, targets, heads[n], base_top1, base)
        inside = torch.zeros(vocab, dtype=torch.bool)
        inside[heads[n]] = True
        agreement[n]["choice_coverage"] = round(inside[choose_tokens].float().mean().item(), 4)
        agreement[n]["rows_with_count"] = int((counts[heads[n]] > 0).sum())
        agreement[n]["rogue_last"] = head_agreement(logits, targets, heads_safe[n], base_top1, base)
    # In hindsight (diagnostic only, the evaluation set chose nothing): the rows of this ranking an
    # evaluation token needs, i.e. the head size that would have covered it.
    position = torch.empty(vocab, dtype=torch.long)
    position[base] = base.numel() - 1  # today's rows come as one block
    position[order] = torch.arange(base.numel(), vocab)
    needed = (position[targets] + 1).sort().values
    hindsight = {"rows_for_99.5pct": int(needed[int(np.ceil(COVERAGE_GOAL * needed.numel())) - 1]),
                 "rows_for_100pct": int(needed[-1]),
                 "outside_8192_distinct": int(torch.unique(targets[position[targets] >= base.numel()]).numel())}

    # 3. Variants: convert, check α on llama.cpp, time.
    result_rows: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="drafter-head-", dir="/tmp") as workdir:
        drafters: dict[int, LoadedModel] = {}
        for n in sizes:
            files, seconds, mib = variant(paths["plain"], heads[n], Path(workdir) / str(n), args.weights)
            loaded = dataclasses.replace(drafter, head_ids=heads[n].sort().values, llama=files)
            drafters[n] = loaded
            alpha = llama_alpha(files, loaded.head_ids, vocab, prompts, texts)
            result_rows[n] = {**agreement[n], "alpha_llamacpp": alpha, "convert_s": round(seconds, 2),
                              "gguf_mib": round(mib, 1)}
            log(f"{n} rows: converted in {seconds:.1f}s, {mib:.1f} MiB; {result_rows[n]}")
        rounds = []
        for r in range(args.rounds):
            rounds.append(timing_round(drafters, engine, args.context, args.block, args.repeats))
            log(f"timing round {r + 1}: {rounds[-1]}")
    target_ms = min(r["target_ms"] for r in rounds)
    for n in sizes:
        draft = min(r["drafters"][n]["draft_ms_per_token"] for r in rounds)
        feed = min(r["drafters"][n]["feed_ms"] for r in rounds)
        result_rows[n].update({"draft_ms_per_token": draft, "feed_ms": feed, "c": round(draft / target_ms, 3),
                               "c_feed": round(feed / target_ms, 3)})
    load_after = busy()
    result = {
        "cpu": cpu_model(), "cores": usable_cores(), "threads": 1,
        "under_load": bool(load_before or load_after), "load": sorted(set(load_before + load_after)),
        "drafter": str(paths["plain"]), "weights": args.weights, "tiebreak": args.tiebreak,
        "choose": {"prompts": len(questions), **sources, "tokens_per_prompt": args.choose_tokens,
                   "target_tokens": int(choose_tokens.numel()), "distinct_ids_outside_8192": seen_outside,
                   "engine": "llamacpp " + engine.capabilities.dtype, "rogue": rogues},
        "eval": {"prompts": args.eval_prompts, "tokens": args.eval_tokens, "positions": int(targets.numel()),
                 "engine": "torch float32", "hindsight": hindsight},
        "timing": {"context": args.context, "block": args.block, "rounds": args.rounds, "repeats": args.repeats,
                   "target_ms": target_ms, "target_weights": engine.capabilities.dtype, "all_rounds": rounds},
        "fit": fit(sizes, [result_rows[n]["feed_ms"] for n in sizes]),
        "goals": {"coverage": COVERAGE_GOAL, "c": C_GOAL},
        "sizes": {str(n): result_rows[n] for n in sizes},
        "seconds": round(time.perf_counter() - started, 1),
    }
    print_table(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, result)


def print_table(result: dict) -> None:
    """One row per head size."""
    t = result["timing"]
    print(f"\n{result['eval']['positions']} evaluation positions; target {t['target_ms']:.2f} ms/token "
          f"(llama.cpp {t['target_weights']}, 1 thread){'; under load' if result['under_load'] else ''}")
    print(f"{'rows':>6} {'cover':>6} {'alpha':>6} {'top4':>6} {'a llama':>7} {'new@1':>6} {'new@4':>6} "
          f"{'feed ms':>7} {'draft ms':>8} {'c':>6} | {'alpha R':>7} {'top4 R':>6} {'new@1 R':>7}")
    for n, r in result["sizes"].items():
        q = r["rogue_last"]
        print(f"{n:>6} {r['coverage']:>6.4f} {r['alpha']:>6.4f} {r['top4']:>6.4f} {r['alpha_llamacpp']:>7.4f} "
              f"{r['newly_covered_top1']:>2}/{r['newly_covered']:<3} "
              f"{r['newly_covered_top4']:>2}/{r['newly_covered']:<3} "
              f"{r['feed_ms']:>7.3f} {r['draft_ms_per_token']:>8.3f} {r['c']:>6.3f} | {q['alpha']:>7.4f} "
              f"{q['top4']:>6.4f} {q['newly_covered_top1']:>3}/{q['newly_covered']:<3}")
    f = result["fit"]
    print(f"new@k: evaluation tokens outside today's head but inside this one that the drafter ranks in its top k. "
          f"R: the same sizes with the {result['choose']['rogue']['rows']} rogue rows ranked last.\n"
          f"feed ms ≈ {f['layers_ms']:.3f} + {f['per_1k_rows_ms']:.4f} × rows/1000; "
          f"hindsight: {result['eval']['hindsight']}")


if __name__ == "__main__":
    main()
