"""The sampling transform against brute-force definitions."""
import pytest
import torch

from hybridspec.common.protocol.errors import InvalidArgument
from hybridspec.common.maths.sampling import SamplingParams, logits_to_probs


def brute_force(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    x = (logits / t).tolist()
    order = sorted(range(len(x)), key=lambda i: -x[i])
    keep = set(order[:k] if k else order)
    z = torch.softmax(torch.tensor([x[i] if i in keep else float("-inf") for i in range(len(x))]), 0)
    mass, kept = 0.0, set()
    for i in sorted(keep, key=lambda i: -x[i]):
        if mass >= p:
            break
        kept.add(i)
        mass += float(z[i])
    out = torch.tensor([x[i] if i in kept else float("-inf") for i in range(len(x))])
    return torch.softmax(out, 0)


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.5), (2.0, 1, 1.0)])
def test_transform_matches_brute_force(t, k, p):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(40, generator=gen) * 3
        got = logits_to_probs(logits, SamplingParams(temperature=t, top_k=k, top_p=p))
        torch.testing.assert_close(got, brute_force(logits, t, k, p), atol=1e-6, rtol=1e-5)


def test_greedy_scores_are_plain_softmax():
    logits = torch.randn(3, 50)
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams()), torch.softmax(logits, -1))


def test_batched_rows_are_independent():
    logits = torch.randn(4, 30)
    params = SamplingParams(temperature=0.9, top_k=7, top_p=0.9)
    rows = torch.stack([logits_to_probs(r, params) for r in logits])
    torch.testing.assert_close(logits_to_probs(logits, params), rows)


@pytest.mark.parametrize("kwargs,field", [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"),
                                          ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")])
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidArgument, match=field):
        SamplingParams(**kwargs)
