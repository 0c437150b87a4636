"""Offline τ (tokens committed per round) of draft chains against draft trees, for the embedded drafter.

    taskset -c 1 python bench/tree_tau.py [--prompts 8] [--tokens 96] [--temperature 0.7]
        [--sampled-tokens 48] [--out FILE]

Greedy (T = 0): on each free-form prompt (distill/prompts.py, the set lab's `freeform:N` names) the
target's own greedy continuation of `--tokens` tokens is replayed round by round from the committed
context: a chain of γ = 4 (`ModelDrafter.propose`) or a tree (edge/tree_draft.py, depth ≤ 8, top_k 4)
is drafted, the accepted path is the longest root path that matches the continuation (what
`verify_tree_greedy` accepts there), τ = accepted + 1, and the context moves on by τ tokens of the
continuation. For both drafter LMs (torch fp32 and llama.cpp on the shipped GGUF, one thread each):
mean τ and drafting time per round. Along the continuations, the drafter's top-1/2/4/8 agreement with
the target's token (α = top-1) and the head's coverage of the target's tokens.

Sampled (T = `--temperature`, 0 to skip; the llama.cpp drafter): real rounds with
`verify_tree_speculative` (common/maths/tree_verification.py). The target's probabilities at every
node come from the target itself as a `TorchLM` (edge/draft_lm.py): its cache holds the committed
context and `feed_tree` scores the tree in one pass with a 4-D mask, exactly the root path's logits.
Each setting generates `--sampled-tokens` tokens per prompt from the same seeds; the target's two
passes a round (the committed tokens, the tree) make this the costly part, hence fewer tokens than
the greedy replay. Prints a table; --out writes the numbers as JSON.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hybridspec.common.maths.sampling import logits_to_probs, round_generator
from hybridspec.common.maths.tree_verification import verify_tree_speculative
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.loading import LoadedModel, load_model
from hybridspec.common.protocol.tree import chain_parents, children
from hybridspec.common.protocol.wire import SamplingParams
from hybridspec.distill.prompts import FREEFORM_PROMPTS
from hybridspec.edge.draft_lm import TorchLM
from hybridspec.edge.drafter import ModelDrafter
from hybridspec.edge.drafters import make_drafter
from hybridspec.edge.prompt import encode_prompt
from hybridspec.edge.proposal import DraftSettings, Drafting, DrafterKind, Proposal
from hybridspec.edge.tree_draft import TreeBudget, draft_tree
from harness import arguments, references, write_json

GAMMA = 4
TREE_NODES = (4, 8, 16, 32)
DEPTH, TOP_K = 8, 4
SETTINGS = ["chain-4"] + [f"tree-{n}" for n in TREE_NODES]
AGREEMENT_RANKS = (1, 2, 4, 8)


def draft(drafter: ModelDrafter, context: list[int], setting: str) -> Proposal:
    """One round's draft: a chain of γ or a tree of the setting's node budget."""
    if setting.startswith("chain"):
        proposal = drafter.propose(context, GAMMA)
        return Proposal(proposal.ids, proposal.dists, proposal.fell_back, parents=chain_parents(len(proposal.ids)))
    return draft_tree(drafter, context, TreeBudget(int(setting.split("-")[1]), DEPTH, TOP_K))


def matched(proposal: Proposal, text: list[int]) -> int:
    """Length of the longest root path whose tokens are text's first ones."""
    kids, node, depth = children(proposal.parents), -1, 0
    while depth < len(text):
        node = next((c for c in kids[node + 1] if proposal.ids[c] == text[depth]), None)
        if node is None:
            break
        depth += 1
    return depth


@torch.inference_mode()
@torch.inference_mode()
def agreement(drafter: LoadedModel, prompts: list[list[int]], texts: list[list[int]]) -> dict:
    """Along the continuations: how often the target's token is among the drafter's top r, and in its head."""
    vocab = drafter.vocab_size
    hits = dict.fromkeys(AGREEMENT_RANKS, 0)
    positions = 0
    for prompt, text in zip(prompts, texts):
        lm = TorchLM(drafter, vocab)
        logits = lm.advance(prompt)
        for token in text:
            top = logits.topk(max(AGREEMENT_RANKS)).indices.tolist()
            for r in AGREEMENT_RANKS:
                hits[r] += token in top[:r]
            positions += 1
            logits = lm.feed([token])
    head = set(drafter.head_ids.tolist()) if drafter.head_ids is not None else None
    covered = sum(t in head for text in texts for t in text) if head is not None else positions
    return {"positions": positions, **{f"top{r}": round(hits[r] / positions, 4) for r in AGREEMENT_RANKS},
            "head_coverage": round(covered / positions, 4)}


def greedy_replay(loaded: LoadedModel, settings: DraftSettings, prompts: list[list[int]],
                  texts: list[list[int]]) -> dict:
    """Mean τ and drafting ms per round of every setting, replaying the target's continuations."""
    result = {}
    for setting in SETTINGS:
        taus, times = [], []
        for prompt, text in zip(prompts, texts):
            drafter = make_drafter(DrafterKind.MODEL, loaded, settings)
            done = 0
            while done < len(text):
                t0 = time.perf_counter()
                proposal = draft(drafter, prompt + text[:done], setting)
                times.append((time.perf_counter() - t0) * 1000)
                tau = min(matched(proposal, text[done:]) + 1, len(text) - done)
                taus.append(tau)
                done += tau
        result[setting] = {"rounds": len(taus), "tau": round(statistics.mean(taus), 3),
                           "draft_ms": round(statistics.mean(times), 2)}
    return result


@torch.inference_mode()
def sampled_run(target: LoadedModel, loaded: LoadedModel, settings: DraftSettings, prompts: list[list[int]],
                tokens: int) -> dict:
    """Mean τ of real speculative rounds at settings.sampling's temperature."""
    vocab = settings.vocab_size
    eos = set(target.eos_token_ids)
    result = {}
    for setting in SETTINGS:
        taus = []
        for index, prompt in enumerate(prompts):
            drafter = make_drafter(DrafterKind.MODEL, loaded, settings)
            verifier = TorchLM(target, vocab)
            committed, generated, round_index = list(prompt), 0, 0
            while generated < tokens and committed[-1] not in eos:
                proposal = draft(drafter, committed, setting)
                n = len(proposal.ids)
                rows = [verifier.advance(committed)] + ([*verifier.feed_tree(proposal.ids, list(proposal.parents))]
                                                        if n else [])
                target_probs = logits_to_probs(torch.stack(rows), settings.sampling)
                draft_probs = torch.zeros(n, vocab)
                for i, dist in enumerate(proposal.dists):
                    draft_probs[i, dist.ids] = dist.probs
                outcome = verify_tree_speculative(proposal.parents, torch.tensor(proposal.ids, dtype=torch.long),
                                                  draft_probs, target_probs,
                                                  round_generator(settings.seed + index, round_index))
                new = [proposal.ids[i] for i in outcome.path] + [outcome.token]
                committed += new
                generated += len(new)
                taus.append(len(new))
                round_index += 1
        result[setting] = {"rounds": len(taus), "tau": round(statistics.mean(taus), 3)}
    return result


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--prompts", type=int, default=8, help="free-form prompts, from the first")
    parser.add_argument("--tokens", type=int, default=96, help="continuation tokens per prompt")
    parser.add_argument("--temperature", type=float, default=0.7, help="the sampled run's; 0 skips it")
    parser.add_argument("--sampled-tokens", type=int, default=48, help="tokens per prompt of the sampled run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the numbers here as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    paths = default_paths()
    target = load_model(paths["target"], device="cpu", engine="torch")
    drafters = {engine: load_model(paths["plain"], device="cpu", engine=engine) for engine in ("torch", "llamacpp")}
    vocab = drafters["torch"].vocab_size
    prompts = [encode_prompt(target.tokenizer, q, chat=True) for q in FREEFORM_PROMPTS[:args.prompts]]
    texts = references(target, prompts, args.tokens)
    no_fallback = Drafting(fallback_threshold=0.0)
    greedy = DraftSettings(sampling=SamplingParams(temperature=0.0), vocab_size=vocab,
                           stop_ids=frozenset(target.eos_token_ids), drafting=no_fallback, seed=args.seed)
    result: dict = {"prompts": args.prompts, "tokens": args.tokens, "gamma": GAMMA, "tree_depth": DEPTH,
                    "tree_top_k": TOP_K, "threads": 1, "agreement": agreement(drafters["torch"], prompts, texts),
                    "greedy": {engine: greedy_replay(d, greedy, prompts, texts) for engine, d in drafters.items()}}
    if args.temperature > 0:
        sampled = DraftSettings(sampling=SamplingParams(temperature=args.temperature), vocab_size=vocab,
                                stop_ids=frozenset(target.eos_token_ids), drafting=no_fallback, seed=args.seed)
        result["sampled"] = {"temperature": args.temperature, "tokens": args.sampled_tokens,
                             **sampled_run(target, drafters["llamacpp"], sampled, prompts, args.sampled_tokens)}
    print_table(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, result)


def print_table(result: dict) -> None:
    """The numbers as a table: one row per setting."""
    a = result["agreement"]
    print(f"{a['positions']} positions: " + ", ".join(f"top-{r} {a[f'top{r}']:.3f}" for r in AGREEMENT_RANKS)
          + f", head coverage {a['head_coverage']:.3f}")
    sampled = result.get("sampled")
    header = f"{'setting':<9} {'tau torch':>9} {'ms torch':>9} {'tau llama':>9} {'ms llama':>9}"
    print(header + (f" {'tau T=' + str(sampled['temperature']):>10}" if sampled else ""))
    for setting in SETTINGS:
        t, ll = result["greedy"]["torch"][setting], result["greedy"]["llamacpp"][setting]
        row = f"{setting:<9} {t['tau']:>9.3f} {t['draft_ms']:>9.2f} {ll['tau']:>9.3f} {ll['draft_ms']:>9.2f}"
        print(row + (f" {sampled[setting]['tau']:>10.3f}" if sampled else ""))


if __name__ == "__main__":
    main()
