"""Batched forward over per-session caches computes what each session would compute alone."""
import random

import pytest
import torch
from transformers import DynamicCache

from hybridspec.cloud.batched_forward import batched_forward

from tinymodels import make_model


def _alone(model, context: list[int], feed: list[int]) -> tuple[torch.Tensor, DynamicCache]:
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        if context:
            model(input_ids=torch.tensor([context]), past_key_values=cache, use_cache=True)
        logits = model(input_ids=torch.tensor([feed]), past_key_values=cache, use_cache=True).logits[0]
    return logits.float(), cache


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_forward_matches_each_session_alone(seed):
    model = make_model(seed=3, layers=2).eval()
    rng = random.Random(seed)
    contexts = [[rng.randrange(4, 200) for _ in range(rng.randint(0, 30))] for _ in range(5)]
    contexts[0] = []  # a session whose cache is still empty
    feeds = [[rng.randrange(4, 200) for _ in range(rng.randint(1, 9))] for _ in range(5)]
    alone = [_alone(model, c, f) for c, f in zip(contexts, feeds)]
    caches = []
    for c in contexts:
        cache = DynamicCache(config=model.config)
        if c:
            with torch.inference_mode():
                model(input_ids=torch.tensor([c]), past_key_values=cache, use_cache=True)
        caches.append(cache)
    lengths_before = [c.get_seq_length() for c in caches]

    logits, new_caches = batched_forward(model, caches, feeds)

    assert [c.get_seq_length() for c in caches] == lengths_before  # inputs untouched
    for (ref_logits, ref_cache), got, cache, feed, ctx in zip(alone, logits, new_caches, feeds, contexts):
        assert got.shape == ref_logits.shape
        torch.testing.assert_close(got, ref_logits, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), ref_logits.argmax(-1))
        assert cache.get_seq_length() == len(ctx) + len(feed)
        for mine, ref in zip(cache.layers, ref_cache.layers):
            torch.testing.assert_close(mine.keys, ref.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(mine.values, ref.values, atol=1e-4, rtol=1e-4)


def test_batched_forward_rejects_empty_feeds():
    model = make_model(seed=3, layers=2).eval()
    with pytest.raises(ValueError, match="at least one token"):
        batched_forward(model, [DynamicCache(config=model.config)], [[]])
