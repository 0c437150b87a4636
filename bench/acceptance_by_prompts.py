"""The shipped drafter's acceptance on the prompts distill reports and on those `pair check` uses,
measured both ways on the same text: distill's teacher-forced agreement and pair check's rounds
through the edge's own drafter.

    python bench/acceptance_by_prompts.py --out docs/drafter/prompt-sets.json

For each prompt set, the embedded target writes its greedy answer to every prompt on the engine
`pair check` and `cloud serve` use (llama.cpp on a CPU, one thread). Along that text:
- distill's measure (distill/evaluate.py): one teacher-forced pass of the torch drafter, the flags
  "the drafter's top choice is the target's token" at every position, their mean (the α docs/distill.md
  reports), and greedy rounds of γ = 8 replayed from them;
- pair check's measure (lab/pairs.py `draft_rounds`): rounds of up to 8 drafts through the edge's drafter
  as it runs on this machine (llama.cpp, the converted GGUF), its cache kept and cut from round to
  round, and the same through the torch drafter, whose rounds must be the replay exactly (a
  `false` would mean the edge drafts from another context than distill scores);
- how much of the text the drafter can predict at all: the share of the target's tokens among the
  rows of its head (8,192 of 49,152, ranked by frequency in its training answers).

The sets: held-out task templates with unseen topics (the 24 prompts bench/acceptance_trace.py uses,
at 48 and at 128 new tokens), the 24 free-form requests (distill/prompts.py FREEFORM_PROMPTS), and
pair check's built-in prompts (lab/pairs.py: four of those free-form requests and four code requests),
together and each half alone.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from harness import arguments, header, report

from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.loading import load_model
from hybridspec.common.protocol.wire import SamplingParams
from hybridspec.distill.data import Sample
from hybridspec.distill.evaluate import agreement_flags, replay
from hybridspec.distill.prompts import FREEFORM_PROMPTS, heldout_prompts
from hybridspec.edge.drafters import make_drafter
from hybridspec.edge.proposal import DraftSettings, DrafterKind
from hybridspec.lab import pairs

MAX_DRAFT = 8  # pair check's default block


def prompt_sets() -> list[tuple[str, list[str], int]]:
    """(name, prompts, new tokens) of every set measured."""
    heldout = heldout_prompts(24, seed=7)  # bench/acceptance_trace.py's (and drafter_quality's first 24)
    return [("held-out templates", heldout, 48), ("held-out templates at 128 tokens", heldout, 128),
            ("free-form chat", list(FREEFORM_PROMPTS), 48),
            ("pair check's built-in prompts", [*pairs.CHAT_PROMPTS, *pairs.CODE_PROMPTS], 48),
            ("pair check's chat prompts", list(pairs.CHAT_PROMPTS), 48),
            ("pair check's code prompts", list(pairs.CODE_PROMPTS), 48)]


def rounds_row(counts: pairs.RoundCounts) -> dict:
    """What pair check reports of a set's rounds."""
    return {"alpha_by_position": [round(a, 3) for a in counts.alphas(MAX_DRAFT)[:MAX_DRAFT]],
            "checked": counts.tries, "rounds": counts.rounds, "accepted_per_round": round(counts.mean_accepted, 3),
            "agreement": round(counts.agreement, 3)}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    began = time.perf_counter()
    cfg = pairs.PairCheckConfig()
    torch.set_num_threads(cfg.threads)
    paths = default_paths()
    engine, target = pairs._target(str(paths["target"]), cfg)
    eos = set(target.eos_token_ids)
    reference = load_model(str(paths["plain"]), device="cpu", engine="torch")
    head = set(reference.head_ids.tolist())
    settings = DraftSettings(sampling=SamplingParams(temperature=0.0), vocab_size=target.vocab_size,
                             stop_ids=frozenset(eos), max_context=cfg.max_context)
    on_llama = pairs._drafter(str(paths["plain"]), target.vocab_size, frozenset(eos), cfg)  # as pair check runs it
    texts: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
    rows = []
    for name, questions, new_tokens in prompt_sets():
        for q in questions:
            if (q, new_tokens) not in texts:
                prompt = pairs._encode(paths["target"], q)
                texts[q, new_tokens] = prompt, pairs._continuation(engine, prompt, new_tokens, eos)
        prompts, answers = zip(*(texts[q, new_tokens] for q in questions))
        flags = agreement_flags(reference.model, reference.head_ids,
                                [Sample(p + a, len(p)) for p, a in zip(prompts, answers)], reference.device)
        tokens = sum(map(len, flags))
        rounds, _, accepted, tries, hits = replay(flags, MAX_DRAFT)
        on_torch = pairs.draft_rounds(make_drafter(DrafterKind.MODEL, reference, settings), prompts, answers, MAX_DRAFT)
        on_edge = pairs.draft_rounds(on_llama, prompts, answers, MAX_DRAFT)
        in_head = [(f, t in head) for row, answer in zip(flags, answers) for f, t in zip(row, answer)]
        rows.append({
            "set": name, "prompts": len(prompts), "new_tokens": new_tokens, "tokens": tokens,
            "distill": {"agreement": round(sum(map(sum, flags)) / tokens, 3),
                        "per_prompt": [round(sum(f) / len(f), 3) for f in flags],
                        "alpha_by_position": [round(h / t, 3) if t else None for h, t in zip(hits, tries)],
                        "accepted_per_round": round(accepted / rounds, 3)},
            "pair_check": {"llamacpp": rounds_row(on_edge), "torch": rounds_row(on_torch),
                           "torch_rounds_are_the_replay": (on_torch.rounds, on_torch.accepted, on_torch.tries,
                                                           on_torch.hits) == (rounds, accepted, tries, hits)},
            "head": {"target_tokens_in_head": round(sum(h for _, h in in_head) / tokens, 3),
                     "agreement_where_in_head": round(sum(f for f, h in in_head if h) / max(1, sum(h for _, h in in_head)), 3)}})
        print(f"{name}: distill α {rows[-1]['distill']['agreement']}, pair check α_1 "
              f"{rows[-1]['pair_check']['llamacpp']['alpha_by_position'][0]}", flush=True)
    report({**header(machine="2 cores, shared with other work", threads=cfg.threads),
            "command": "python bench/acceptance_by_prompts.py" + (f" --out {args.out}" if args.out else ""),
            "target": paths["target"].name, "target_engine": f"{engine.capabilities.name} ({engine.capabilities.dtype})",
            "drafter": paths["plain"].name, "max_draft": MAX_DRAFT, "sets": rows,
            "seconds": round(time.perf_counter() - began, 1)}, args.out)


if __name__ == "__main__":
    main()
