"""Coupled (Gumbel-max, drafter-invariant) speculative sampling: the noise, the rule, exactness in
distribution, and a seed's output being one fixed text whatever drafts it (docs/design.md §2.2)."""
import math

import pytest
import torch
from hybridspec.common.maths import verification as rules
from hybridspec.common.maths.sampling import (
    gumbel_max,
    gumbel_noise,
    gumbel_scores,
    logits_to_probs,
)
from hybridspec.common.protocol.wire import SamplingParams
from hybridspec.edge import generation
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.worker import EdgeWorker
from test_verification import FALSE_ALARM, cases, p_value
from tinymodels import EVERY_ROUND

U64 = (1 << 64) - 1


# ---- the noise --------------------------------------------------------------------------------------

def reference_noise(seed: int, position: int, token: int) -> float:
    """G(seed, t, v) written with Python's unbounded ints: splitmix64 steps, top 53 bits, −log(−log u)."""
    def mix(z):
        z &= U64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
        return z ^ (z >> 31)

    golden = 0x9E3779B97F4A7C15
    z = mix(mix(mix(seed) + position * golden) + token * golden)
    u = ((z >> 11) + 0.5) * 2.0 ** -53
    return -math.log(-math.log(u))


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3, 2**63, U64])
def test_noise_matches_the_plain_integer_hash(seed):
    positions, tokens = [0, 1, 5, 4095, 2**31 + 7], [0, 1, 2, 255, 49151, 151_935]
    got = gumbel_noise(seed, torch.tensor(positions), torch.tensor(tokens))
    want = torch.tensor([[reference_noise(seed, t, v) for v in tokens] for t in positions], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_noise_depends_only_on_seed_position_and_token():
    positions = torch.arange(40, 49)
    full = gumbel_noise(3, positions, torch.arange(50_000))
    # Prefix-consistent across vocabulary sizes, bit for bit.
    for vocab in (1, 7, 256, 32_001):
        assert torch.equal(gumbel_noise(3, positions, torch.arange(vocab)), full[:, :vocab])
    # Any subset, in any order, and any batch of positions: the same values.
    ids = torch.tensor([49_999, 5, 17, 40_000])
    assert torch.equal(gumbel_noise(3, positions[4:5], ids)[0], full[4, ids])
    assert torch.equal(gumbel_noise(3, torch.tensor([46, 41]), ids), full[[6, 1]][:, ids])
    # The same key again gives the same noise; another seed or position gives other noise.
    assert torch.equal(gumbel_noise(3, positions, torch.arange(50_000)), full)
    assert not torch.equal(gumbel_noise(4, positions, torch.arange(100)), full[:, :100])
    assert (full[0] != full[1]).float().mean() > 0.99


def test_noise_is_standard_gumbel():
    from scipy.stats import kstest

    g = gumbel_noise(11, torch.arange(8), torch.arange(20_000)).flatten().numpy()
    assert kstest(g, "gumbel_r").pvalue > FALSE_ALARM
    assert abs(g.mean() - 0.5772156649) < 0.01  # Euler–Mascheroni: the Gumbel mean


@pytest.mark.slow
def test_gumbel_max_draws_are_independent_across_positions_and_seeds():
    """The joint of the draws at two positions over many seeds is the product of the marginals."""
    p0, p1 = torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.4, 0.3, 0.2, 0.1])
    ids = torch.arange(4)
    counts = torch.zeros(4, 4)
    for seed in range(8000):
        counts[gumbel_max(ids, p0, seed, 10), gumbel_max(ids, p1, seed, 11)] += 1
    joint = (p0[:, None] * p1[None, :]).flatten()
    assert p_value(counts.flatten().long(), joint) > FALSE_ALARM


# ---- the rule ---------------------------------------------------------------------------------------

def brute_force_coupled(draft, p, seed, position):
    """The rule as a loop over positions and tokens, with the reference noise."""
    def y(i):
        scores = [math.log(p[i, v]) + reference_noise(seed, position + i, v) if p[i, v] > 0 else -math.inf
                  for v in range(p.shape[1])]
        return max(range(len(scores)), key=scores.__getitem__)

    for i, x in enumerate(draft.tolist()):
        if y(i) != x:
            return i, y(i)
    return len(draft), y(len(draft))


def test_coupled_matches_the_brute_force_loop():
    gen = torch.Generator().manual_seed(5)
    outcomes = set()
    for trial in range(150):
        gamma, vocab, seed, position = 1 + trial % 5, 12, trial, 3 + trial
        p = torch.softmax(torch.randn(gamma + 1, vocab, generator=gen) * 2, -1)
        p[:, trial % vocab] = 0.0  # a truncated token is never drawn
        p = p / p.sum(-1, keepdim=True)
        # Drafts that agree with the target up to a random point, so every k occurs.
        agree = [brute_force_coupled(torch.tensor([], dtype=torch.long), p[i:i + 1], seed, position + i)[1]
                 for i in range(gamma)]
        cut = trial % (gamma + 1)
        draft = torch.tensor([*agree[:cut], *[(t + 1) % vocab for t in agree[cut:]]])
        got = rules.verify_coupled(draft, p, seed, position)
        assert (got.num_accepted, got.token) == brute_force_coupled(draft, p, seed, position)
        outcomes.add(got.num_accepted)
    assert outcomes == set(range(6))


def coupled_emitted(q, p, seeds, position=20):
    """Per output position, the tokens the coupled rule emits over many seeds, drafting x_i with q."""
    gamma, vocab = q.shape
    ids = torch.arange(vocab)
    per_position = [[] for _ in range(gamma + 1)]
    accepted = 0
    for seed in range(seeds):
        # The drafter's own coupled draws (the rows are fixed here, so a draft need not be sequential).
        draft = torch.tensor([gumbel_max(ids[q[i] > 0], q[i][q[i] > 0], seed, position + i) for i in range(gamma)])
        out = rules.verify_coupled(draft, p, seed, position)
        accepted += out.num_accepted
        for j, tok in enumerate([*draft[:out.num_accepted].tolist(), out.token]):
            per_position[j].append(tok)
    counts = [torch.bincount(torch.tensor(t, dtype=torch.long), minlength=vocab) for t in per_position]
    return counts, accepted / (seeds * gamma)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(cases()))
def test_coupled_output_is_distributed_as_p(name):
    q, p = cases()[name]
    counts, acceptance = coupled_emitted(q, p, 20_000)
    for j, c in enumerate(counts):
        if c.sum() < 1000:
            continue  # disjoint supports: later positions are never reached
        assert p_value(c, p[j]) > FALSE_ALARM, f"{name}: position {j} counts {c.tolist()} vs p {p[j].tolist()}"
    if name == "q equals p":
        assert acceptance == 1.0  # same distribution, same noise: the same token every time
    if name == "disjoint supports":
        assert acceptance == 0.0


@pytest.mark.slow
def test_the_distribution_test_catches_emitting_the_draft():
    """Power check: a rule that emits the draft token at a mismatch (instead of the target's draw) is
    biased towards q, and the test above would see it."""
    def emits_the_draft(draft, p, seed, position):
        out = rules.verify_coupled(draft, p, seed, position)
        return out if out.num_accepted == len(draft) else rules.Outcome(out.num_accepted, int(draft[out.num_accepted]))

    q, p = cases()["random q"]
    ids = torch.arange(q.shape[1])
    counts = torch.zeros(q.shape[1], dtype=torch.long)
    for seed in range(5000):
        draft = torch.tensor([gumbel_max(ids, q[0], seed, 20)])
        out = emits_the_draft(draft, p[:2], seed, 20)
        counts[draft[0] if out.num_accepted else out.token] += 1
    assert p_value(counts, p[0]) < FALSE_ALARM


@pytest.mark.slow
def test_coupled_agrees_more_the_closer_q_is_to_p():
    _, p = cases()["random q"]
    near = torch.softmax(torch.log(p[:2]) + 0.1 * torch.randn(2, 6, generator=torch.Generator().manual_seed(1)), -1)
    far = cases()["random q"][0]
    assert coupled_emitted(near, p, 3000)[1] > coupled_emitted(far, p, 3000)[1] + 0.2


@pytest.mark.slow
@pytest.mark.parametrize("name", list(cases()))
def test_coupled_agreement_bounds_speculative_acceptance_from_below(name):
    """What shadow drafting measures when sampling (docs/edge.md): the coupled draws of q and p agree
    at most 1 - TV(p, q) of the time (the speculative rule's acceptance; no coupling agrees more) and
    at least (1 - TV) / (1 + TV) (Daliri, Musco & Suresh), over the noise of many seeds."""
    q, p = cases()[name]
    ids, seeds = torch.arange(p.shape[1]), 3000
    for row in range(q.shape[0]):
        qs, ps = q[row], p[row]
        agree = sum(gumbel_max(ids[qs > 0], qs[qs > 0], seed, 9) == gumbel_max(ids[ps > 0], ps[ps > 0], seed, 9)
                    for seed in range(seeds)) / seeds
        accept = float(torch.minimum(qs, ps).sum())
        slack = 4 * math.sqrt(max(accept * (1 - accept), 1e-4) / seeds)
        tv = 1 - accept
        assert (1 - tv) / (1 + tv) - slack <= agree <= accept + slack, f"{name} row {row}: {agree} vs 1 - TV {accept}"


# ---- end to end: one text per seed, distributed as the target's sampling ----------------------------

PROMPT = [5, 17, 33, 80, 17, 33]


def run(server, drafter, **cfg):
    config = EdgeConfig.of(cloud=server.address, **{"max_new_tokens": 24, "temperature": 0.8, "seed": 7,
                                                 "mode": "coupled", **cfg})
    with VerifierClient(server.address) as client:
        return EdgeWorker(drafter, client, config).generate(PROMPT).token_ids


@torch.inference_mode()
def target_alone(target, prompt, n, params, seed):
    """The target decoding alone, each token drawn by Gumbel-max with the noise of its position."""
    ids = list(prompt)
    for _ in range(n):
        logits = target.model(torch.tensor([ids])).logits[0, -1].float()
        probs = logits_to_probs(logits, params)
        support = torch.nonzero(probs > 0, as_tuple=True)[0]
        ids.append(gumbel_max(support, probs[support], seed, len(ids)))
        if ids[-1] in target.eos_token_ids:
            break
    return ids[len(prompt):]


def test_a_seed_gives_one_text_whatever_drafts_it(server, target, random_drafter):
    want = target_alone(target, PROMPT, 24, SamplingParams(temperature=0.8), seed=7)
    assert run(server, random_drafter, cloud_only=True) == want
    variants = [dict(EVERY_ROUND, max_draft=1), dict(EVERY_ROUND, max_draft=3), dict(EVERY_ROUND, max_draft=8),
                dict(EVERY_ROUND, max_draft=3, pipeline=False), {}, dict(EVERY_ROUND, drafter_kind="ngram")]
    for cfg in variants:
        assert run(server, random_drafter, **cfg) == want, cfg
    # A drafter equal to the target drafts the very tokens the verifier draws: all of them are accepted.
    assert run(server, target, **EVERY_ROUND, max_draft=4, wire_top_k=0, fallback_threshold=0.0) == want
    assert run(server, random_drafter, seed=8, **EVERY_ROUND) != want


def test_top_k_and_top_p_keep_one_text_per_seed(server, target, random_drafter):
    params = SamplingParams(temperature=1.2, top_k=20, top_p=0.9)
    want = target_alone(target, PROMPT, 24, params, seed=3)
    cfg = {"temperature": 1.2, "top_k": 20, "top_p": 0.9, "seed": 3}
    assert run(server, random_drafter, cloud_only=True, **cfg) == want
    assert run(server, random_drafter, **EVERY_ROUND, max_draft=5, **cfg) == want


@pytest.mark.slow
def test_coupled_is_distributed_as_the_target_end_to_end(server, target):
    """Over seeds, the first two tokens through a real verifier follow the target's joint distribution.

    The drafter is the target with q cut to its 2 most likely tokens: it agrees with the verifier's
    draw often but not always, so acceptances and corrections are both exercised.
    """
    params = SamplingParams(temperature=1.0, top_k=4)
    with torch.inference_mode():
        first = logits_to_probs(target.model(torch.tensor([PROMPT])).logits[0, -1].float(), params)
        joint = torch.zeros(256, 256)
        for a in torch.nonzero(first, as_tuple=True)[0].tolist():
            second = logits_to_probs(target.model(torch.tensor([PROMPT + [a]])).logits[0, -1].float(), params)
            joint[a] = first[a] * second
    counts = torch.zeros(256, 256, dtype=torch.long)
    accepted = 0
    with VerifierClient(server.address) as client:
        for seed in range(600):
            config = EdgeConfig.of(cloud=server.address, max_new_tokens=2, temperature=1.0, top_k=4, seed=seed,
                                   mode="coupled", max_draft=1, wire_top_k=2, fallback_threshold=0.0, pipeline=False,
                                   **EVERY_ROUND)
            gen = EdgeWorker(target, client, config).generate(PROMPT)
            counts[gen.token_ids[0], gen.token_ids[1]] += 1
            accepted += gen.stats.accepted
    assert joint[joint > 0].min() * 600 >= 5  # chi-square needs expected counts of 5 or more
    assert p_value(counts.flatten(), joint.flatten()) > FALSE_ALARM  # zero-probability pairs fail outright
    assert 100 < accepted < 550  # both acceptances and corrections happened


def test_a_seeded_run_repeats(server, random_drafter):
    """Regression: a seeded sampling run (`--temperature 0.8 --seed 7`, otherwise default settings:
    adaptive γ, pipelining, switching to cloud-only) gives the same text every time, also when γ
    differs. A seed selects the coupled rule; verifier draws keyed by round, as speculative sampling's
    are, depend on γ and timing."""
    cfg = {"temperature": 0.8, "seed": 7}
    assert EdgeConfig.of(**cfg).resolved_mode.value == "coupled"
    with VerifierClient(server.address) as client:
        worker = EdgeWorker(random_drafter, client, EdgeConfig.of(cloud=server.address, max_new_tokens=24, **cfg))
        texts = [worker.generate(PROMPT).token_ids for _ in range(3)]  # measurements (and γ) change between them
        for gamma in (1, 4):
            config = EdgeConfig.of(cloud=server.address, max_new_tokens=24, max_draft=gamma, **EVERY_ROUND, **cfg)
            texts.append(EdgeWorker(random_drafter, client, config).generate(PROMPT).token_ids)
    assert all(t == texts[0] for t in texts), texts


def test_without_a_seed_each_sampled_run_draws_its_own(server, random_drafter):
    """No seed: standard rejection sampling with a fresh seed per generation, so runs differ."""
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=24, temperature=1.0)
    assert config.resolved_mode.value == "speculative"
    with VerifierClient(server.address) as client:
        worker = EdgeWorker(random_drafter, client, config)
        texts = {tuple(worker.generate(PROMPT).token_ids) for _ in range(3)}
    assert len(texts) > 1


def test_coupled_needs_no_q_on_the_wire():
    from hybridspec.common.protocol.wire import Mode

    assert not Mode.COUPLED.uses_draft_probs
    with pytest.raises(Exception, match="temperature > 0"):
        Mode.COUPLED.check_temperature(0.0)
    assert gumbel_scores(torch.tensor([0.0, 1.0]), torch.zeros(2))[0] == -math.inf


@pytest.mark.parametrize("mode, measured", [("coupled", True), ("speculative", True), ("bild", False)])
def test_shadow_drafting_measures_agreement_when_sampling(server, target, mode, measured, monkeypatch):
    """Regression: at temperature > 0 a cloud-only stream measured no acceptance, so a new edge tried
    hybrid on an assumed α of 0.9. The drafter's coupled draw now guesses along with the stream; with
    the target itself drafting (and q not truncated) nearly every guess agrees. BiLD's threshold
    rule is not measured this way. (Every token is guessed here: which tokens the edge can afford to
    guess depends on the machine's timing, tests/test_edge_modes.py checks that rule.)"""
    monkeypatch.setattr(generation, "SHADOW_UNAFFORDABLE_EVERY", 1)
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=24, temperature=0.8, seed=7, mode=mode,
                           wire_top_k=0, max_draft=4)
    with VerifierClient(server.address) as client:
        worker = EdgeWorker(target, client, config)
        gen = worker.generate(PROMPT)
    assert gen.stats.cloud_only_tokens > 0
    if mode == "coupled":
        assert gen.token_ids == target_alone(target, PROMPT, 24, SamplingParams(temperature=0.8), seed=7)
    checked = sum(worker.estimates.checked)  # agreeing guesses count at the next position, as a block's would
    if not measured:
        assert checked == 0
        return
    assert checked >= 12, worker.estimates.checked
    # From a prior of 0.5, 16 agreeing guesses lift every position above 0.8; two misses in a
    # position would keep it below 0.75.
    assert sum(worker.estimates.alphas[:4]) / 4 > 0.75, worker.estimates.alphas
