"""A pass's decisions taken together (cloud/core/rules.py `decide_pass`, `prepare_pass`): one argmax over
every greedy round's rows, the sampling rounds' probabilities from one copy to the host, transformed
together per setting. Each round must get exactly what it would have computed alone, in every mode, for chains and
trees, penalized or not, whether its logits are a slice of the pass's (the torch engine) or a tensor of
their own (llama.cpp)."""
import random

import pytest
import torch

from hybridspec.cloud.core.rules import Prepared, apply_rule, decide_pass, joined, prepare_pass, row_argmaxes
from hybridspec.common.maths.sampling import logits_to_probs
from hybridspec.common.protocol.tree import chain_parents, children
from hybridspec.common.protocol.wire import DraftBlock, Mode, SamplingParams, SessionSpec
from test_tree_rules import random_tree

VOCAB = 48
SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
            SamplingParams(temperature=1.3, top_p=0.6), SamplingParams(temperature=1.0, top_k=12, top_p=0.9)]
PENALIZED = SamplingParams(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.5)


def random_round(rng: random.Random, i: int) -> tuple[SessionSpec, DraftBlock, list[int]]:
    """A session of a random mode and setting (a few shared, so groups have members), and its block."""
    mode = rng.choice(list(Mode))
    if mode is Mode.GREEDY:
        sampling = rng.choice([SamplingParams(), SamplingParams(repetition_penalty=1.2)])
    elif mode is Mode.BILD and rng.random() < 0.5:
        sampling = SamplingParams()
    else:
        sampling = rng.choice([*SETTINGS, PENALIZED])
    committed = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 12))]
    if mode.verifies_trees and rng.random() < 0.5:
        parents, tokens = random_tree(rng, 7, VOCAB)
    else:
        tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 5))]
        parents = chain_parents(len(tokens))
    support, probs = [], []
    if mode.uses_draft_probs:
        kids = children(parents)
        q_of = {}  # parent -> (support, probs): siblings were drawn from one q
        for node, parent in enumerate(parents):
            if parent not in q_of:
                group = {tokens[c] for c in kids[parent + 1]}
                ids = sorted(group | set(rng.sample(range(VOCAB), 3)))
                weights = [rng.random() + 0.05 for _ in ids]
                q_of[parent] = (tuple(ids), tuple(w / sum(weights) for w in weights))
            support.append(q_of[parent][0])
            probs.append(q_of[parent][1])
    spec = SessionSpec(f"s{i}", tuple(committed), sampling=sampling, mode=mode, seed=rng.randrange(2**31),
                       rollback_threshold=2.0, lenience=0.7, prompt_len=max(1, len(committed) - 3))
    block = DraftBlock(f"s{i}", rng.randrange(5), len(committed), tuple(tokens), tuple(support), tuple(probs),
                       tuple(parents) if len(parents) and parents != chain_parents(len(parents)) else ())
    return spec, block, committed


def pass_logits(rng: random.Random, blocks: list[DraftBlock], adjacent: bool) -> list[torch.Tensor]:
    """Each round's rows: slices of one pass's logits (adjacent) or tensors of their own; integer
    logits make ties, so argmax tie-breaking is tested too."""
    rows = [len(block.draft_ids) + 1 for block in blocks]
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    whole = torch.randint(-4, 5, (sum(rows), VOCAB), generator=g).float() * rng.choice([0.5, 1.0, 3.0])
    parts = list(whole.split(rows))
    return parts if adjacent else [part.clone() for part in parts]


@pytest.mark.parametrize("adjacent", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_a_pass_decides_every_round_as_the_round_alone(seed, adjacent):
    rng = random.Random(seed)
    rounds = [random_round(rng, i) for i in range(rng.randint(1, 14))]
    logits = pass_logits(rng, [block for _, block, _ in rounds], adjacent)
    prepared = prepare_pass([spec for spec, _, _ in rounds], logits)
    for (spec, block, committed), rows, ready in zip(rounds, logits, prepared):
        plain = spec.mode is Mode.GREEDY and not spec.sampling.penalized
        assert (ready.best is not None) == plain
        assert (ready.probs is not None) == (spec.mode is not Mode.GREEDY and not spec.sampling.penalized)
        if ready.probs is not None:  # the very bits the round's own transform gives
            assert torch.equal(ready.probs, logits_to_probs(rows.cpu(), spec.sampling))
        assert apply_rule(spec, block, rows, committed, ready) == apply_rule(spec, block, rows, list(committed))


@pytest.mark.parametrize("told", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_a_pass_decided_at_once_decides_every_round_as_the_round_alone(seed, told):
    """decide_pass, whether the engine says where each round's rows lie in the pass's logits (`rows`: a
    torch engine's pass, whose logits hold other feeds' rows too) or not, gives each round what apply_rule
    gives it alone; a round whose rule fails gets its own exception and the others their decisions."""
    rng = random.Random(seed)
    rounds = [random_round(rng, i) for i in range(rng.randint(1, 14))]
    counts = [len(block.draft_ids) + 1 for _, block, _ in rounds]
    whole = torch.randint(-4, 5, (sum(counts) + 6, VOCAB), generator=torch.Generator().manual_seed(seed)).float()
    firsts = [3 + sum(counts[:i]) for i in range(len(counts))]  # three rows before them, three after
    logits = [whole[first:first + n] for first, n in zip(firsts, counts)]
    broken = rng.randrange(len(rounds))
    logits[broken] = logits[broken][:-1] if counts[broken] > 1 else whole[:0]  # a row short: its rule fails
    decisions = decide_pass([spec for spec, _, _ in rounds], [block for _, block, _ in rounds], logits,
                            [list(committed) for _, _, committed in rounds],
                            (whole, [slice(first, first + len(rows)) for first, rows in zip(firsts, logits)])
                            if told else None)
    for i, ((spec, block, committed), rows, decision) in enumerate(zip(rounds, logits, decisions)):
        if i == broken:
            assert isinstance(decision, Exception)
        else:
            assert decision == apply_rule(spec, block, rows, list(committed))


def test_the_modes_and_shapes_above_are_all_drawn():
    """The random rounds cover every mode, trees and chains, penalized and not (so the test above can fail)."""
    seen = set()
    for seed in range(12):
        rng = random.Random(seed)
        for spec, block, _ in (random_round(rng, i) for i in range(rng.randint(1, 14))):
            seen.add((spec.mode, block.is_tree, spec.sampling.penalized))
    assert {mode for mode, _, _ in seen} == set(Mode)
    assert {(Mode.SPECULATIVE, True, False), (Mode.GREEDY, True, False), (Mode.COUPLED, False, False)} <= seen
    assert any(penalized for _, _, penalized in seen)


def test_adjacent_rows_are_joined_without_a_copy_and_others_are_copied():
    whole = torch.randn(9, 7)
    parts = list(whole.split([2, 3, 4]))
    view = joined(parts)
    assert view.data_ptr() == whole.data_ptr() and torch.equal(view, whole)
    assert joined(parts[1:]).data_ptr() == parts[1].data_ptr()
    gapped = [parts[0], parts[2]]  # a gap between them: copied, in order
    assert torch.equal(joined(gapped), torch.cat(gapped)) and joined(gapped).data_ptr() != whole.data_ptr()
    assert torch.equal(joined([whole[:, :3]]), whole[:, :3])  # not contiguous: copied


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # numpy's path, and the device path's
@pytest.mark.parametrize("adjacent", [True, False])
def test_row_argmaxes_break_ties_by_the_first_maximum_as_torch_does(adjacent, dtype):
    g = torch.Generator().manual_seed(3)
    whole = torch.randint(0, 3, (12, 40), generator=g).to(dtype)
    parts = list(whole.split([1, 5, 2, 4]))
    parts = parts if adjacent else [p.clone() for p in parts]
    assert row_argmaxes(parts) == [p.argmax(dim=-1).tolist() for p in parts]
    assert row_argmaxes([]) == []


def test_a_failed_preparation_leaves_each_rule_its_own_logits():
    spec, block = SessionSpec("s", (5, 6)), DraftBlock("s", 0, 2, (7, 8))
    rows = torch.randn(3, VOCAB)
    assert apply_rule(spec, block, rows, [5, 6], Prepared()) == apply_rule(spec, block, rows, [5, 6],
                                                                          prepare_pass([spec], [rows])[0])
