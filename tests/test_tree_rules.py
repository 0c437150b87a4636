"""The tree verification rules: golden cases, brute force, chains against the chain rules, exactness
of recursive rejection sampling (by exact computation and by χ² with a power check), and coupled
drafter invariance."""
import random
from collections import Counter
from fractions import Fraction
from itertools import product

import pytest
import torch
from scipy.stats import chisquare

from hybridspec.common.maths import verification as chain_rules
from hybridspec.common.maths.sampling import gumbel_max
from hybridspec.common.maths.tree_verification import (TreeOutcome, verify_tree_coupled, verify_tree_greedy,
                                                        verify_tree_speculative)
from hybridspec.common.protocol.tree import ROOT, chain_parents, children, path_to
from test_verification import FALSE_ALARM, one_hot

# ---- golden cases ---------------------------------------------------------------------------------
# Root children: node 0 (token 5) and node 1 (token 3); node 2 (token 2) under node 0; nodes 3 (token 0)
# and 4 (token 4) under node 1. Rows 1, 3 and 4 (nodes 0, 2, 3) point at 5, a token no child there has.
GOLDEN_PARENTS = (ROOT, ROOT, 0, 1, 1)
GOLDEN_IDS = torch.tensor([5, 3, 2, 0, 4])


GOLDEN = [  # (argmax of rows 0, 2, 5) -> outcome
    ((3, 4, 1), TreeOutcome((1, 4), 1)),  # the 2nd sibling, then the 2nd child, a leaf: bonus 1
    ((3, 2, 1), TreeOutcome((1,), 2)),  # 2 is a cousin's token, not a child of node 1: a correction
    ((1, 4, 1), TreeOutcome((), 1)),  # no root child matches
]


@pytest.mark.parametrize("rows, want", GOLDEN)
def test_golden_one_hot_target(rows, want):
    p = one_hot([rows[0], 5, rows[1], 5, 5, rows[2]], 6)
    assert verify_tree_greedy(GOLDEN_PARENTS, GOLDEN_IDS, p * 5) == want
    # One-hot rows leave the Gumbel draw no choice, whatever the seed.
    for seed in range(5):
        assert verify_tree_coupled(GOLDEN_PARENTS, GOLDEN_IDS, p, seed, position=17) == want
    # Nor rejection sampling: a sibling is rejected surely unless it is p's token, then accepted surely
    # (the first sibling's residual max(0, p − q_1) is p again, and q_2 is one-hot on the 2nd sibling).
    q = torch.zeros(5, 6)  # per sibling group, q uniform over the group's tokens
    q[[0, 1], 5] = q[[0, 1], 3] = q[[3, 4], 0] = q[[3, 4], 4] = 0.5
    q[2, 2] = 1.0
    for seed in range(20):
        assert verify_tree_speculative(GOLDEN_PARENTS, GOLDEN_IDS, q, p, torch.Generator().manual_seed(seed)) == want


def test_speculative_correction_comes_from_the_updated_residual():
    # q = (½, ½, 0) draws 0 then 1; p = (0, ½, ½). Token 0 is rejected surely, leaving the residual
    # max(0, p − q) = (0, 0, ½): p is now one-hot on 2, so token 1 is rejected surely too and 2 emitted.
    # A rule that kept the old p would accept token 1 half of the time.
    q = torch.tensor([[0.5, 0.5, 0.0]] * 2)
    p = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    for seed in range(50):
        out = verify_tree_speculative((ROOT, ROOT), torch.tensor([0, 1]), q, p, torch.Generator().manual_seed(seed))
        assert out == TreeOutcome((), 2)


def test_shape_errors_are_caught_at_the_entry():
    with pytest.raises(AssertionError, match="parents"):
        verify_tree_greedy((ROOT,), torch.tensor([1, 2]), torch.zeros(3, 5))
    with pytest.raises(AssertionError, match="draft_probs"):
        verify_tree_speculative((ROOT, ROOT), torch.tensor([1, 2]), torch.zeros(2, 4), torch.zeros(3, 5), None)


# ---- random trees -----------------------------------------------------------------------------------

def random_tree(rng, max_nodes, vocab, wanted=None):
    """Parents and distinct-per-group sibling tokens; wanted(prefix), when given, is a token the tree
    takes for a child of a node with that path, more often than not, so that long paths match."""
    parents, tokens = [], []
    for _ in range(rng.randint(0, max_nodes)):
        parent = rng.randint(ROOT, len(parents) - 1)
        used = {tokens[j] for j in range(len(parents)) if parents[j] == parent}
        prefix = tuple(tokens[j] for j in path_to(parents, parent))
        choice = wanted(prefix) if wanted and rng.random() < 0.6 else rng.randrange(vocab)
        if choice in used:
            choice = rng.choice([v for v in range(vocab) if v not in used] or [None])
        if choice is None:
            continue  # the group holds every token already
        parents.append(parent)
        tokens.append(choice)
    return tuple(parents), tokens


def brute_force_greedy(parents, tokens, logits):
    """Among all root paths, the longest whose every token is the argmax of its parent's row."""
    best = [max(range(len(row)), key=row.__getitem__) for row in logits.tolist()]
    paths = [[]] + [path_to(parents, node) for node in range(len(parents))]
    good = [path for path in paths if all(tokens[node] == best[parents[node] + 1] for node in path)]
    path = max(good, key=len)
    return TreeOutcome(tuple(path), best[path[-1] + 1 if path else 0])


def test_greedy_matches_brute_force_on_random_trees():
    rng = random.Random(0)
    depths = Counter()
    for trial in range(400):
        parents, tokens = random_tree(rng, 9, 4)
        logits = torch.randn(len(parents) + 1, 4, generator=torch.Generator().manual_seed(trial))
        got = verify_tree_greedy(parents, torch.tensor(tokens, dtype=torch.long), logits)
        assert got == brute_force_greedy(parents, tokens, logits), (parents, tokens)
        depths[len(got.path)] += 1
    assert depths[0] and depths[1] and sum(c for d, c in depths.items() if d >= 2) >= 20, depths


# ---- chains: the tree rules are the chain rules ---------------------------------------------------

def as_tree(out):
    """A chain rule's Outcome as the TreeOutcome of the chain: the path is nodes 0..k-1."""
    return TreeOutcome(tuple(range(out.num_accepted)), out.token)


def test_greedy_and_coupled_on_chains_are_the_chain_rules():
    rng = random.Random(1)
    for trial in range(200):
        gen = torch.Generator().manual_seed(trial)
        n = trial % 7
        p = torch.softmax(torch.randn(n + 1, 5, generator=gen) * 2, -1)
        p[p < 0.05] = 0.0  # a truncated support, as top-k/top-p leave it
        seed, position = rng.randrange(2**32), rng.randrange(1000)
        support = [torch.nonzero(row > 0)[:, 0] for row in p]
        coupled = [gumbel_max(s, row[s], seed, position + i) for i, (s, row) in enumerate(zip(support, p))]
        best = p.argmax(-1).tolist()
        for target_tokens in (best, coupled):  # drafts that mostly agree, so that k varies
            draft = torch.tensor([t if rng.random() < 0.8 else rng.randrange(5) for t in target_tokens[:n]],
                                 dtype=torch.long)
            chain = chain_parents(n)
            assert verify_tree_greedy(chain, draft, p.log()) == as_tree(chain_rules.verify_greedy(draft, p.log()))
            want = as_tree(chain_rules.verify_coupled(draft, p, seed, position))
            assert verify_tree_coupled(chain, draft, p, seed, position) == want


# ---- speculative: exact computation ---------------------------------------------------------------
# A 3-token vocabulary; the target's and the drafter's conditionals for every prefix a depth-2 tree
# can reach. Output: the round's emitted tokens, continued by the target to 3 tokens.
VOCAB = 3
CHAIN = chain_parents(2)
TREE = (ROOT, ROOT, 0, 0, 0, 1)  # 2 root children; 3 under the first (all of q's support), 1 under the second


def dist(*weights):
    return tuple(Fraction(w, sum(weights)) for w in weights)


TARGET = {(): dist(2, 3, 5), (0,): dist(1, 0, 3), (1,): dist(4, 4, 2), (2,): dist(1, 6, 3),
          **{prefix: dist(*weights) for prefix, weights in zip(
              product(range(VOCAB), repeat=2),
              [(1, 1, 1), (3, 0, 1), (0, 2, 5), (6, 3, 1), (1, 2, 2), (2, 0, 0), (1, 4, 4), (5, 1, 3), (0, 1, 1)])}}
DRAFTER = {(): dist(7, 2, 1), (0,): dist(1, 1, 6), (1,): dist(3, 6, 1), (2,): dist(1, 2, 2)}


def drawn_trees(parents):
    """Every token assignment the edge can draw (siblings from the parent's q, without replacement,
    in order), with its probability."""
    def extend(i, tokens, weight):
        if i == len(parents):
            yield tuple(tokens), weight
            return
        taken = {tokens[j] for j in range(i) if parents[j] == parents[i]}
        prefix = tuple(tokens[j] for j in path_to(parents, parents[i]))
        q = [0 if x in taken else v for x, v in enumerate(DRAFTER[prefix])]
        for x in range(VOCAB):
            if q[x]:
                yield from extend(i + 1, [*tokens, x], weight * q[x] / sum(q))
    return extend(0, [], Fraction(1))


def exact_outcomes(parents, tokens, renormalise=True, residual=True):
    """The law of the emitted tokens for one drawn tree, acceptance probabilities integrated over u.
    renormalise=False (q_j = q: siblings taken as drawn with replacement) and residual=False (p never
    updated after a rejection) are the two mistakes the power checks must catch."""
    kids = children(parents)

    def at(node, prefix):
        p, q = list(TARGET[prefix]), list(DRAFTER.get(prefix, ()))
        law, reach = Counter(), Fraction(1)  # reach: the chance that every earlier sibling was rejected
        for c in kids[node + 1]:
            x = tokens[c]
            q_j = [v / sum(q) for v in q] if renormalise else list(DRAFTER[prefix])
            accept = min(Fraction(1), p[x] / q_j[x])
            for rest, prob in at(c, prefix + (x,)).items():
                law[(x,) + rest] += reach * accept * prob
            reach *= 1 - accept
            if residual and any(a > b for a, b in zip(p, q_j)):
                p = [max(Fraction(0), a - b) for a, b in zip(p, q_j)]
                p = [v / sum(p) for v in p]
            q[x] = Fraction(0)
        for t in range(VOCAB):
            law[(t,)] += reach * p[t]
        return law

    return at(ROOT, ())


def outcome_law(parents, **mistakes):
    law = Counter()
    for tokens, weight in drawn_trees(parents):
        for seq, prob in exact_outcomes(parents, tokens, **mistakes).items():
            law[seq] += weight * prob
    return law


def continued(law, length=3):
    """The law of the first `length` tokens when the target itself continues every output."""
    out = Counter()
    for seq, prob in law.items():
        for tail in product(range(VOCAB), repeat=length - len(seq)):
            full, weight = seq, prob
            for t in tail:
                weight *= TARGET[full][t]
                full += (t,)
            out[full] += weight
    return out


TARGET_JOINT = continued({(): Fraction(1)})


@pytest.mark.parametrize("parents", [CHAIN, TREE], ids=["chain", "tree"])
def test_speculative_is_exact_by_exact_computation(parents):
    assert sum(w for _, w in drawn_trees(parents)) == 1
    law = outcome_law(parents)
    assert sum(law.values()) == 1
    assert continued(law) == TARGET_JOINT  # equal as fractions, not just to 1e-6
    assert sum(prob for seq, prob in law.items() if len(seq) == 3) > Fraction(1, 10)  # acceptances happen


# ---- speculative: Monte Carlo through the function under test ----------------------------------------

TRIALS = 4000
ROWS = {prefix: torch.tensor([float(v) for v in probs]) for prefix, probs in TARGET.items()}
QROWS = {prefix: torch.tensor([float(v) for v in probs]) for prefix, probs in DRAFTER.items()}


def as_tree_rule(parents, ids, q, p, gen):
    return as_tree(chain_rules.verify_speculative(ids, q, p, gen))


def tree_rows(parents, tokens):
    """draft_probs (q of each node's parent path) and target_probs (root row, then each node's path)."""
    prefixes = [tuple(tokens[j] for j in path_to(parents, node)) for node in range(len(parents))]
    return (torch.stack([QROWS[prefix[:-1]] for prefix in prefixes]),
            torch.stack([ROWS[()], *(ROWS[prefix] for prefix in prefixes)]))


def sampled_outputs(rule, parents, trials, seed):
    """Draw each tree as the edge does, verify it with `rule`: the emitted token sequences."""
    gen = torch.Generator().manual_seed(seed)
    outputs = []
    for _ in range(trials):
        tokens = []
        for i, parent in enumerate(parents):
            q = QROWS[tuple(tokens[j] for j in path_to(parents, parent))].clone()
            q[[tokens[j] for j in range(i) if parents[j] == parent]] = 0.0  # without replacement
            tokens.append(int(torch.multinomial(q, 1, generator=gen)))
        out = rule(parents, torch.tensor(tokens, dtype=torch.long), *tree_rows(parents, tokens), gen)
        outputs.append(tuple(tokens[c] for c in out.path) + (out.token,))
    return outputs


def pooled_p_value(samples, law):
    """χ² goodness of fit; cells expected < 5 times are pooled, a zero-probability outcome fails."""
    counts = Counter(samples)
    if any(not law.get(seq) for seq in counts):
        return 0.0
    expected, observed = Counter(), Counter()
    for seq, prob in law.items():
        cell = seq if prob * len(samples) >= 5 else "pooled"
        expected[cell] += float(prob) * len(samples)
        observed[cell] += counts[seq]
    cells = [cell for cell in expected if expected[cell] > 0]
    return float(chisquare([observed[c] for c in cells], [expected[c] for c in cells]).pvalue)


def continue_sample(seq, gen):
    """`seq` continued to 3 tokens by the target."""
    while len(seq) < 3:
        seq += (int(torch.multinomial(ROWS[seq], 1, generator=gen)),)
    return seq


@pytest.mark.parametrize("rule, parents", [(verify_tree_speculative, TREE), (verify_tree_speculative, CHAIN),
                                           (as_tree_rule, CHAIN)], ids=["tree", "chain", "chain rule"])
@pytest.mark.slow
def test_speculative_output_matches_the_exact_law(rule, parents):
    outputs = sampled_outputs(rule, parents, TRIALS, seed=5)
    # The emitted sequences follow the rule's exact law (so acceptances happen as often as they
    # should), and continued by the target they follow the target's joint law. For a chain, the tree
    # rule and verify_speculative pass against the same law: they have the same distribution.
    assert pooled_p_value(outputs, outcome_law(parents)) > FALSE_ALARM
    gen = torch.Generator().manual_seed(6)
    assert pooled_p_value([continue_sample(seq, gen) for seq in outputs], TARGET_JOINT) > FALSE_ALARM


@pytest.mark.parametrize("mistake", [{"renormalise": False}, {"residual": False}], ids=["with replacement", "stale p"])
def test_the_chi_square_test_catches_a_wrong_rule(mistake):
    """Power check: TRIALS outputs of a wrong variant (drawn from its exact law) fail the same test."""
    law = continued(outcome_law(TREE, **mistake))
    assert sum(law.values()) == 1
    assert sum(abs(law[s] - TARGET_JOINT[s]) for s in TARGET_JOINT) / 2 > Fraction(1, 50)  # total variation
    seqs = list(law)
    gen = torch.Generator().manual_seed(9)
    draws = torch.multinomial(torch.tensor([float(law[s]) for s in seqs]), TRIALS, replacement=True, generator=gen)
    assert pooled_p_value([seqs[i] for i in draws.tolist()], TARGET_JOINT) < FALSE_ALARM


def test_speculative_is_deterministic_per_seed():
    tokens = torch.tensor([0, 2, 0, 1, 2, 1])
    q, p = tree_rows(TREE, tokens.tolist())
    outs = [verify_tree_speculative(TREE, tokens, q, p, torch.Generator().manual_seed(s)) for s in range(40)]
    again = [verify_tree_speculative(TREE, tokens, q, p, torch.Generator().manual_seed(s)) for s in range(40)]
    assert outs == again
    assert len(set(outs)) > 3  # the seed matters


# ---- coupled: the output is the target's own text, whatever the tree ---------------------------------

def conditional(prefix, vocab=5):
    """The target's p after `prefix`: a fixed random row with a truncated support."""
    seed = sum((t + 1) * 7**i for i, t in enumerate(prefix))
    p = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2, -1)
    p[p < 0.04] = 0.0
    return p / p.sum()


def test_coupled_emits_the_target_text_for_any_tree():
    rng = random.Random(2)
    matched = Counter()
    for _ in range(150):
        seed, position = rng.randrange(2**64), rng.randrange(10_000)
        text = []  # the target alone, decoding with the coupled draw at each position
        for d in range(10):
            p = conditional(tuple(text))
            support = torch.nonzero(p > 0)[:, 0]
            text.append(gumbel_max(support, p[support], seed, position + d))
        parents, tokens = random_tree(rng, 10, 5, wanted=lambda prefix: text[len(prefix)])
        prefixes = [tuple(tokens[j] for j in path_to(parents, node)) for node in range(len(parents))]
        target_probs = torch.stack([conditional(()), *(conditional(prefix) for prefix in prefixes)])
        out = verify_tree_coupled(parents, torch.tensor(tokens, dtype=torch.long), target_probs, seed, position)
        emitted = [tokens[c] for c in out.path] + [out.token]
        assert emitted == text[:len(emitted)]
        # ... and the path is the longest root path spelling a prefix of the text.
        assert len(out.path) == max([0] + [len(prefix) for prefix in prefixes if list(prefix) == text[:len(prefix)]])
        matched[len(out.path)] += 1
    assert matched[0] and sum(c for d, c in matched.items() if d >= 2) >= 10, matched
