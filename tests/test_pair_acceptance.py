"""`pair check`'s acceptance (lab/pairs.py: rounds of drafts through the edge's own drafter, its cache
kept and cut across rounds) is distill's (distill/evaluate.py: one teacher-forced pass of the drafter
over the target's text, rounds replayed from the agreement flags), round for round, on the same text.
So where the two numbers differ, the prompts or the statistic differ, not the drafting. A tiny
compact drafter over a text built to agree with it in runs, plus the real embedded pair."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import require_embedded
from hybridspec.common.models.compact import Manifest
from hybridspec.common.models.loading import load_model
from hybridspec.distill.data import Sample
from hybridspec.distill.evaluate import agreement_flags, replay
from hybridspec.lab import pairs

MAX_DRAFT = 8
# Where the tiny text leaves the drafter's choice: a 1-token run, a run longer than a block (a block
# fully accepted, then the bonus position), and a last run of 3 that the text's end cuts short.
LENGTH, DISAGREE = 30, (3, 4, 13, 26)


@pytest.fixture(scope="module")
def tiny(model_dirs, target, tmp_path_factory):
    """A 2-layer compact drafter of the tiny target over a shuffled 160-row head (loaded into torch)."""
    from hybridspec.distill.student import build_student, own_state, save_compact

    head_ids = torch.randperm(256, generator=torch.Generator().manual_seed(0))[:160]
    student = build_student(target.model, 2, head_ids)
    out = tmp_path_factory.mktemp("compact") / "drafter"
    save_compact(own_state(student), head_ids, out, Manifest(base=str(model_dirs["target"]), num_layers=2,
                                                             base_tokenizer_fingerprint=""))
    return out


@torch.inference_mode()
def text_in_runs(loaded, prompt: list[int]) -> list[int]:
    """LENGTH tokens, each the drafter's choice after the ones before (one full pass, as distill scores
    it) except at DISAGREE, where it is the drafter's second choice."""
    ids = list(prompt)
    for i in range(LENGTH):
        ranked = loaded.model(input_ids=torch.tensor([ids])).logits[0, -1].topk(2).indices
        ids.append(int(loaded.head_ids[ranked[1 if i in DISAGREE else 0]]))
    return ids[len(prompt):]


def assert_rounds_are_the_replay(counts: pairs.RoundCounts, flags: list[list[bool]]) -> None:
    rounds, _, accepted, tries, hits = replay(flags, MAX_DRAFT)
    assert (counts.rounds, counts.accepted, counts.tries, counts.hits) == (rounds, accepted, tries, hits)


def test_pair_check_rounds_are_the_replay_of_distills_flags(tiny):
    cfg = pairs.PairCheckConfig(max_context=512)
    drafter = pairs._drafter(str(tiny), 256, frozenset(), cfg)  # as pair check loads it: torch, no GGUF here
    reference = load_model(tiny, device="cpu", engine="torch")
    prompts = [np.random.default_rng(seed).integers(4, 256, 12).tolist() for seed in (1, 2)]
    texts = [text_in_runs(reference, p) for p in prompts]
    flags = agreement_flags(reference.model, reference.head_ids, [Sample(p + t, len(p)) for p, t in zip(prompts, texts)],
                            reference.device)
    assert flags == [[i not in DISAGREE for i in range(LENGTH)]] * 2  # the text is what it was built to be
    counts = pairs.draft_rounds(drafter, prompts, texts, MAX_DRAFT)
    assert_rounds_are_the_replay(counts, flags)
    # Every position but a round's last token of the text and a full block's bonus one is checked once.
    assert counts.agreement == sum(counts.hits) / sum(counts.tries)
    assert counts.prompt_agreement == [counts.agreement] * 2


@pytest.mark.embedded
def test_the_shipped_drafter_as_the_edge_runs_it_scores_what_distill_scores(llama_engine):
    """On one of pair check's chat prompts and one of its code prompts, along the text the llama.cpp
    target writes: the torch drafter's rounds are the replay of the teacher-forced flags exactly; the
    llama.cpp drafter's (Q8_0, near-ties broken its own way) nearly so."""
    require_embedded()
    from hybridspec.common.models.embedded import default_paths
    from hybridspec.common.models.loading import load_drafter
    from hybridspec.edge.drafters import make_drafter
    from hybridspec.edge.proposal import DraftSettings, DrafterKind
    from hybridspec.common.protocol.wire import SamplingParams

    paths = default_paths()
    reference = load_model(paths["plain"], device="cpu", engine="torch")
    eos = set(reference.eos_token_ids)
    prompts = [pairs._encode(paths["target"], p) for p in (pairs.CHAT_PROMPTS[0], pairs.CODE_PROMPTS[0])]
    texts = [pairs._continuation(llama_engine, p, 48, eos) for p in prompts]
    flags = agreement_flags(reference.model, reference.head_ids, [Sample(p + t, len(p)) for p, t in zip(prompts, texts)],
                            reference.device)
    settings = DraftSettings(sampling=SamplingParams(temperature=0.0), vocab_size=reference.vocab_size,
                             stop_ids=frozenset(eos), max_context=4096)
    on_torch = pairs.draft_rounds(make_drafter(DrafterKind.MODEL, reference, settings), prompts, texts, MAX_DRAFT)
    assert_rounds_are_the_replay(on_torch, flags)
    on_llama = load_drafter(paths["plain"], "cpu", "auto", "llamacpp", 1)
    assert on_llama.llama is not None
    counts = pairs.draft_rounds(make_drafter(DrafterKind.MODEL, on_llama, settings), prompts, texts, MAX_DRAFT)
    assert abs(counts.rounds - on_torch.rounds) <= 2 and abs(sum(counts.hits) - sum(on_torch.hits)) <= 2
