"""The edge's decisions: block length against the analytic optimum, the cloud-only crossover,
BiLD fallback, prompt lookup, and the running estimates."""
import pytest
import torch

from hybridspec.common.protocol.wire import SamplingParams
from hybridspec.edge import policy
from hybridspec.edge.drafter import ModelDrafter, NgramDrafter
from hybridspec.edge.proposal import DraftSettings, Drafting
from hybridspec.edge.estimates import Estimates

T = 0.05  # the target's time per token, seconds


def rates(alpha: float, c: float, r: float, v: float = 1.0, gammas: int = 65) -> policy.Rates:
    """docs/design.md §2 units: drafter c·T per token, round trip r·T, verification v·T whatever γ."""
    return policy.Rates(alphas=[alpha] * gammas, draft_s=c * T, rtt_s=r * T, verify_single_s=v * T,
                        verify_block_s=v * T, verify_per_draft_s=0.0, cloud_token_s=T)


def analytic_speedup(alpha: float, c: float, r: float, v: float, gamma: int) -> float:
    """S = (1 − α^(γ+1)) / ((1 − α)(γc + r + v)), docs/design.md §2."""
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + r + v))


def test_expected_tokens_is_the_closed_form():
    for alpha in (0.1, 0.5, 0.9):
        for gamma in range(10):
            assert policy.expected_tokens([alpha] * 10, gamma) == pytest.approx((1 - alpha ** (gamma + 1)) / (1 - alpha))


@pytest.mark.parametrize("alpha", [0.3, 0.5, 0.7, 0.8, 0.9])
@pytest.mark.parametrize("c", [0.02, 0.1, 0.3])
@pytest.mark.parametrize("r", [0.0, 0.5, 2.0, 10.0])
def test_gamma_chooser_picks_the_analytic_optimum(alpha, c, r):
    best = max(range(1, 17), key=lambda g: analytic_speedup(alpha, c, r, 1.0, g))
    assert policy.choose_gamma(rates(alpha, c, r), 16, pipelined=False) == best
    speedup = policy.hybrid_rate(rates(alpha, c, r), best, False) / policy.cloud_only_rate(rates(alpha, c, r))
    assert speedup == pytest.approx(analytic_speedup(alpha, c, r, 1.0, best))


def test_best_block_grows_with_rtt():
    chosen = [policy.choose_gamma(rates(0.8, 0.1, r), 32, False) for r in (0, 0.5, 1, 2, 5, 10, 20)]
    assert chosen == sorted(chosen) and chosen[-1] > chosen[0]


@pytest.mark.parametrize("alpha", [0.5, 0.6, 0.75])
def test_switch_to_cloud_only_at_the_predicted_crossover(alpha):
    """With free drafting, hybrid beats cloud-only only while RTT < T·α/(1 − α) (v = 1)."""
    crossover = alpha / (1 - alpha)
    below, above = rates(alpha, 1e-6, 0.95 * crossover), rates(alpha, 1e-6, 1.05 * crossover)
    assert not policy.prefer_cloud_only(below, 64, False, now_cloud_only=False, hysteresis=0.0)
    assert policy.prefer_cloud_only(above, 64, False, now_cloud_only=False, hysteresis=0.0)


def test_hysteresis_keeps_the_current_mode_near_the_crossover():
    at = rates(0.6, 1e-6, 1.5)  # exactly at the crossover 0.6/0.4
    assert not policy.prefer_cloud_only(at, 64, False, now_cloud_only=False)
    assert policy.prefer_cloud_only(at, 64, False, now_cloud_only=True)


def test_pipelining_hides_drafting_when_blocks_are_accepted():
    r = rates(0.9, 0.3, 2.0)
    assert policy.round_seconds(r, 8, pipelined=True) < policy.round_seconds(r, 8, pipelined=False)
    never = rates(0.0, 0.3, 2.0)
    assert policy.round_seconds(never, 8, True) == pytest.approx(policy.round_seconds(never, 8, False))


# ---- BiLD fallback in the drafter ---------------------------------------------------------------

def _greedy_path(model, context, n):
    """(token, max probability) for n greedy steps, by plain full forwards."""
    out, ctx = [], list(context)
    with torch.inference_mode():
        for _ in range(n):
            probs = torch.softmax(model(input_ids=torch.tensor([ctx])).logits[0, -1].float(), -1)
            out.append((int(probs.argmax()), float(probs.max())))
            ctx.append(out[-1][0])
    return out


def settings(target, **kw) -> DraftSettings:
    return DraftSettings(sampling=SamplingParams(), vocab_size=target.vocab_size, stop_ids=frozenset(),
                         drafting=Drafting(wire_top_k=0, **kw))


@pytest.mark.parametrize("keep", [True, False], ids=["keep (HF)", "drop (BiLD)"])
def test_fallback_ends_the_block_at_the_first_unsure_token(target, keep):
    context = [5, 17, 33, 80]
    path = _greedy_path(target.model, context, 8)
    threshold = sorted(p for _, p in path)[len(path) // 2]  # some steps fall below, some do not
    first_unsure = next(i for i, (_, p) in enumerate(path) if p < threshold)
    drafter = ModelDrafter(target, settings(target, fallback_threshold=threshold, keep_low_confidence=keep))
    proposal = drafter.propose(context, 8)
    expected = [t for t, _ in path[: first_unsure + (1 if keep else 0)]]
    assert proposal.ids == expected
    assert proposal.fell_back


def test_no_fallback_below_the_threshold_drafts_the_whole_block(target):
    drafter = ModelDrafter(target, settings(target, fallback_threshold=0.0))
    proposal = drafter.propose([5, 17, 33, 80], 6)
    assert len(proposal.ids) == 6 and not proposal.fell_back
    # fallback=False (drafting alone, shadow guesses) ignores even a threshold every step is below.
    unsure = ModelDrafter(target, settings(target, fallback_threshold=1.0))
    assert len(unsure.propose([5, 17, 33, 80], 6, fallback=False).ids) == 6


def test_interrupt_stops_drafting_between_tokens(target):
    drafter = ModelDrafter(target, settings(target, fallback_threshold=0.0))
    calls = iter([False, False, True])
    assert len(drafter.propose([5, 6], 8, interrupt=lambda: next(calls)).ids) == 2


# ---- prompt lookup ------------------------------------------------------------------------------

def test_ngram_copies_what_followed_the_latest_match():
    drafter = NgramDrafter(SamplingParams(), max_ngram=3)
    context = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 1, 2, 3]
    assert drafter.propose(context, 3).ids == [7, 8, 4]  # the latest [1, 2, 3] wins
    assert drafter.propose([4, 5, 6], 3).ids == []  # nothing repeats
    stopping = NgramDrafter(SamplingParams(), max_ngram=3, stop_ids=frozenset({8}))
    assert stopping.propose(context, 3).ids == [7, 8]  # stops after a stop id


def test_ngram_q_is_one_hot_when_sampling():
    proposal = NgramDrafter(SamplingParams(temperature=1.0)).propose([3, 4, 3], 2)
    assert proposal.ids == [4, 3]
    assert [(d.ids.tolist(), d.probs.tolist()) for d in proposal.dists] == [([4], [1.0]), ([3], [1.0])]


# ---- estimates ----------------------------------------------------------------------------------

def test_per_position_acceptance_converges():
    est = Estimates(max_positions=4)
    for i in range(400):  # position 1 always accepted, position 2 half the time, never beyond
        second = i % 2 == 0
        est.observe_round(drafted=4, accepted=2 if second else 1)
    a = est.alphas
    assert a[0] == pytest.approx(1.0, abs=0.02)
    assert a[1] == pytest.approx(0.5, abs=0.1)
    assert a[2] == pytest.approx(0.0, abs=0.02)


def test_verify_cost_separates_the_empty_block_and_fits_the_rest():
    est = Estimates(max_positions=8)
    est.cloud_token_s.add(0.040)  # stands in for t_v(0) until an empty block is seen
    for gamma in (4, 2, 6, 4, 8, 1):
        est.observe_verify(gamma, 0.070 + 0.002 * gamma)
    r = est.rates(rates(0.5, 0.1, 0.1))
    assert r.verify_single_s == pytest.approx(0.040)
    assert r.verify_s(4) == pytest.approx(0.078, abs=1e-3) and r.verify_per_draft_s == pytest.approx(0.002, abs=1e-4)
    est.observe_verify(0, 0.044)
    assert est.rates(rates(0.5, 0.1, 0.1)).verify_s(0) == pytest.approx(0.044)


def test_verify_cost_is_flat_while_block_sizes_do_not_vary():
    est = Estimates(max_positions=8)
    for _ in range(5):
        est.observe_verify(4, 0.080)
    r = est.rates(rates(0.5, 0.1, 0.1))
    assert r.verify_s(4) == pytest.approx(0.080) and r.verify_s(8) == pytest.approx(0.080)


def test_estimates_lose_no_observation_under_concurrent_updates(monkeypatch):
    """`edge serve` runs generations on several threads against one worker's estimates, and a
    background ping writes the RTT meanwhile. Each update reads and writes; without a lock a thread
    switch between the two loses updates. With no decay the estimates are plain sums, so any lost
    update shows."""
    import sys
    import threading

    from hybridspec.edge import estimates as module

    monkeypatch.setattr(module, "DECAY", 1.0)
    threads, per_thread = 8, 4000
    estimates = Estimates(max_positions=1, prior_weight=2.0)
    fit = module.LinearFit(decay=1.0)

    def hammer():
        for _ in range(per_thread):
            estimates.observe_shadow(True, 0)
            fit.add(1.0, 1.0)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        workers = [threading.Thread(target=hammer) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(interval)
    n = threads * per_thread
    assert estimates._tries[0] == 2.0 + n
    assert fit._s[0] == n


@pytest.mark.parametrize("alpha, c, r, v", [(0.8, 0.05, 0.5, 1.2), (0.5, 0.2, 0.0, 1.0), (0.95, 0.1, 2.0, 1.5)])
def test_best_speedup_is_the_closed_form_bound(alpha, c, r, v):
    """With i.i.d. α, no pipelining and one verify cost, the policy's speed-up is design.md §2's bound."""
    rates = policy.Rates(alphas=[alpha] * 10, draft_s=c, rtt_s=r, verify_single_s=v, verify_block_s=v,
                         verify_per_draft_s=0.0, cloud_token_s=1.0)
    assert policy.best_speedup(rates, 8, pipelined=False) == pytest.approx(
        max(analytic_speedup(alpha, c, r, v, g) for g in range(1, 9)))
