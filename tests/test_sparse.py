"""The exact sparse wire form of q."""
import torch

from hybridspec.common.maths.sparse import truncate


def test_truncate_keeps_the_most_likely_and_renormalises():
    probs = torch.softmax(torch.randn(100, generator=torch.Generator().manual_seed(1)), 0)
    sparse = truncate(probs, 10)
    assert sparse.ids.numel() == 10
    assert set(sparse.ids.tolist()) == set(torch.topk(probs, 10).indices.tolist())
    torch.testing.assert_close(sparse.probs.sum(), torch.tensor(1.0))
    torch.testing.assert_close(sparse.probs, probs[sparse.ids] / probs[sparse.ids].sum())


def test_full_support_round_trips_exactly():
    probs = torch.softmax(torch.randn(64), 0)
    sparse = truncate(probs, 0)
    dense = torch.zeros(64).index_put((sparse.ids,), sparse.probs)
    torch.testing.assert_close(dense, probs / probs.sum(), atol=0, rtol=0)


def test_zero_mass_tokens_never_enter_the_support():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5])
    assert sorted(truncate(probs, 0).ids.tolist()) == [1, 3]


def test_samples_follow_the_sparse_distribution():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    sparse = truncate(probs, 2)  # {2: 2/3, 3: 1/3}
    gen = torch.Generator().manual_seed(0)
    draws = torch.tensor([sparse.sample(gen) for _ in range(6000)])
    assert set(draws.tolist()) <= {2, 3}
    assert abs((draws == 2).float().mean().item() - 2 / 3) < 0.03
