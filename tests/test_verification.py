"""The verification rules: golden cases, a plain-loop reference, seeded determinism, distributions."""
import math

import pytest
import torch
from scipy.stats import chisquare

from hybridspec.common.maths import verification as rules
from hybridspec.common.maths.bild import first_rollback_index, should_fall_back
from hybridspec.common.maths.sampling import sample

FALSE_ALARM = 1e-4  # per chi-square test; with < 10 such tests the suite's false-alarm rate is < 1e-3
DRAWS = 100_000


def one_hot(ids, vocab):
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


# ---- greedy -------------------------------------------------------------------------------------

def test_greedy_perfect_match_takes_the_bonus():
    logits = one_hot([3, 1, 4, 2], 6) * 5
    assert rules.verify_greedy(torch.tensor([3, 1, 4]), logits) == rules.Outcome(3, 2)


def test_greedy_early_mismatch_emits_the_target_token():
    logits = one_hot([3, 1, 4, 2], 6) * 5
    assert rules.verify_greedy(torch.tensor([3, 5, 4]), logits) == rules.Outcome(1, 1)
    assert rules.verify_greedy(torch.tensor([0, 1, 4]), logits) == rules.Outcome(0, 3)


def test_greedy_empty_draft_returns_the_next_token():
    assert rules.verify_greedy(torch.tensor([], dtype=torch.long), one_hot([4], 6)) == rules.Outcome(0, 4)


def test_shape_errors_are_caught_at_the_entry():
    with pytest.raises(AssertionError, match="γ\\+1"):
        rules.verify_greedy(torch.tensor([1, 2]), torch.zeros(2, 5))


# ---- speculative: golden cases --------------------------------------------------------------------

def test_speculative_accepts_everything_when_q_equals_p_one_hot():
    p = one_hot([2, 0, 1], 3)
    out = rules.verify_speculative(torch.tensor([2, 0]), p[:2], p, torch.Generator().manual_seed(0))
    assert out == rules.Outcome(2, 1)


def test_speculative_rejects_a_token_the_target_rules_out():
    q = torch.tensor([[0.5, 0.5, 0.0]])
    p = torch.tensor([[0.0, 0.2, 0.8], [1 / 3, 1 / 3, 1 / 3]])
    for seed in range(50):
        out = rules.verify_speculative(torch.tensor([0]), q, p, torch.Generator().manual_seed(seed))
        assert out.num_accepted == 0
        assert out.token == 2  # the residual max(0, p - q) puts all its mass on token 2


# ---- speculative: plain-loop reference and determinism -------------------------------------------

def reference_speculative(draft, q, p, gen, lenience=1.0):
    """The rule written as a loop, consuming the generator exactly as the vectorised one does."""
    u = torch.rand(len(draft), generator=gen)
    for i, x in enumerate(draft.tolist()):
        if u[i].item() >= min(1.0, p[i, x].item() / (lenience * q[i, x].item())):
            residual = [max(0.0, p[i, v].item() - lenience * q[i, v].item()) for v in range(p.shape[1])]
            if sum(residual) <= 0:
                residual = p[i].tolist()
            return i, sample(torch.tensor(residual), gen)
    return len(draft), sample(p[len(draft)], gen)


def random_case(gen, gamma, vocab):
    q = torch.softmax(torch.randn(gamma, vocab, generator=gen) * 2, -1)
    p = torch.softmax(torch.randn(gamma + 1, vocab, generator=gen) * 2, -1)
    draft = torch.stack([torch.multinomial(q[i], 1, generator=gen)[0] for i in range(gamma)])
    return draft, q, p


@pytest.mark.parametrize("lenience", [1.0, 0.5])
def test_speculative_matches_the_loop_reference(lenience):
    gen = torch.Generator().manual_seed(7)
    for trial in range(300):
        draft, q, p = random_case(gen, gamma=1 + trial % 6, vocab=12)
        got = rules.verify_speculative(draft, q, p, torch.Generator().manual_seed(trial), lenience)
        want = reference_speculative(draft, q, p, torch.Generator().manual_seed(trial), lenience)
        assert (got.num_accepted, got.token) == want


def test_speculative_is_deterministic_per_seed():
    draft, q, p = random_case(torch.Generator().manual_seed(3), gamma=5, vocab=50)
    outs = [rules.verify_speculative(draft, q, p, torch.Generator().manual_seed(s)) for s in range(40)]
    again = [rules.verify_speculative(draft, q, p, torch.Generator().manual_seed(s)) for s in range(40)]
    assert outs == again
    assert len(set(outs)) > 1  # the seed matters


# ---- speculative: the output is distributed exactly as p -------------------------------------------

def emitted_tokens(rule, q, p, draws, seed):
    """Run `rule` `draws` times, drafting x_i ~ q_i; return the emitted tokens per output position."""
    gamma, vocab = q.shape
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(q[i], draws, replacement=True, generator=gen) for i in range(gamma)], 1)
    per_position = [[] for _ in range(gamma + 1)]
    for row in drafts:
        out = rule(row, q, p, gen)
        for j, tok in enumerate([*row[:out.num_accepted].tolist(), out.token]):
            per_position[j].append(tok)
    return [torch.bincount(torch.tensor(t, dtype=torch.long), minlength=vocab) for t in per_position]


def p_value(counts, probs):
    """Chi-square goodness of fit; any draw of a zero-probability token fails outright."""
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    observed = counts[support].double().numpy()
    expected = probs[support].double().numpy()
    expected = expected * observed.sum() / expected.sum()
    return float(chisquare(observed, expected).pvalue)


def cases():
    vocab = 6
    p = torch.tensor([[0.3, 0.25, 0.2, 0.15, 0.1, 0.0],
                      [0.05, 0.05, 0.1, 0.2, 0.3, 0.3],
                      [0.5, 0.0, 0.1, 0.1, 0.1, 0.2]])
    disjoint = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.0, 0.0, 0.0, 0.0]])
    same = p[:2].clone()
    full = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.2, 0.1], [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]])
    topk = torch.zeros_like(full)  # q truncated to its top 2 and renormalised, as the edge sends it
    for i in range(2):
        idx = torch.topk(full[i], 2).indices
        topk[i, idx] = full[i, idx] / full[i, idx].sum()
    skewed = torch.softmax(torch.randn(2, vocab, generator=torch.Generator().manual_seed(5)) * 3, -1)
    return {"disjoint supports": (disjoint, p), "q equals p": (same, p), "top-k truncated q": (topk, p),
            "random q": (skewed, p)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(cases()))
def test_speculative_output_is_distributed_as_p(name):
    q, p = cases()[name]
    counts = emitted_tokens(rules.verify_speculative, q, p, DRAWS, seed=11)
    # Position 0 is always emitted; position 1 after one acceptance; position 2 is the bonus token.
    for j, c in enumerate(counts):
        if c.sum() < 1000:
            continue  # e.g. disjoint supports: the bonus position is never reached
        assert p_value(c, p[j]) > FALSE_ALARM, f"{name}: position {j} counts {c.tolist()} vs p {p[j].tolist()}"
    if name == "q equals p":
        assert counts[2].sum() > DRAWS * 0.9  # everything accepted, so the bonus token is tested too


@pytest.mark.slow
def test_the_distribution_test_catches_a_wrong_residual():
    """Power check: sampling the correction from p instead of max(0, p − q) is biased and detected."""
    def wrong_rule(draft, q, p, gen):
        out = rules.verify_speculative(draft, q, p, gen)
        if out.num_accepted < len(draft):
            return rules.Outcome(out.num_accepted, sample(p[out.num_accepted], gen))
        return out

    q, p = cases()["random q"]
    counts = emitted_tokens(wrong_rule, q, p, 20_000, seed=11)
    assert p_value(counts[0], p[0]) < FALSE_ALARM


# ---- BiLD --------------------------------------------------------------------------------------

def test_fallback_fires_below_the_threshold_only():
    assert should_fall_back(torch.tensor([0.5, 0.3, 0.2]), 0.6)
    assert not should_fall_back(torch.tensor([0.7, 0.3]), 0.6)
    assert not should_fall_back(torch.tensor([0.6, 0.4]), 0.6)  # equal is confident enough
    assert not should_fall_back(torch.tensor([0.1] * 10), 0.0)  # 0 disables the fallback


def test_rollback_index_is_the_first_token_above_the_cross_entropy_threshold():
    p = torch.tensor([[0.9, 0.1], [0.5, 0.5], [0.001, 0.999], [0.5, 0.5]])
    # −log p: 0.105, 0.693, 6.9 → with α_RB = 5 the third token (index 2) is rolled back.
    assert first_rollback_index(torch.tensor([0, 1, 0]), p, 5.0) == 2
    assert first_rollback_index(torch.tensor([0, 1, 1]), p, 5.0) == 3
    assert first_rollback_index(torch.tensor([1, 1, 1]), p, -math.log(0.2)) == 0


def test_bild_keeps_plausible_tokens_a_greedy_rule_would_reject():
    p = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.2, 0.8]])
    draft = torch.tensor([1, 1])  # neither is the argmax, both have −log p < 5
    assert rules.verify_greedy(draft, p.log()).num_accepted == 0
    assert rules.verify_bild(draft, p, 5.0, None) == rules.Outcome(2, 1)
    assert rules.verify_bild(draft, p, 1.0, None) == rules.Outcome(1, 0)  # −log 0.3 = 1.2 > 1
