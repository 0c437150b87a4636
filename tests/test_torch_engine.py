"""The torch engine computes a token's scores to the same bits wherever the token sits: decoded alone,
inside a γ-block, in a batch of other sessions, as a node of a draft tree, after any prefill
chunking. And those scores are the model's: they agree with Hugging Face's forward."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hybridspec.cloud.engine.base import Feed
from hybridspec.cloud.engine.llama import random_weights
from hybridspec.cloud.engine.torch_engine import TorchEngine, engine_for
from hybridspec.cloud.engine.torch_ops import row_floor
from hybridspec.common.protocol.tree import feed_parents, path_to

from conftest import require_embedded


def cached(engine, ids: list[int], chunk: int = 0) -> object:
    """A new sequence with `ids` cached (fed in chunks of `chunk`, or at once)."""
    kv = engine.new_sequence()
    engine.reserve(kv, len(ids))
    step = chunk or len(ids)
    for start in range(0, len(ids), step):
        engine.forward([Feed(kv, ids[start:start + step], scored=False)])
    return kv


def decoded(engine, context: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """Each of `tokens` scored as a cloud-only decode step: one token per pass, after `context`."""
    kv = cached(engine, context)
    out = []
    for token in tokens:
        engine.reserve(kv, 1)
        (scores,) = engine.forward([Feed(kv, [token], scored=True)])
        out.append(scores.logits[0])
    engine.release(kv)
    return out


def random_tree(rng: random.Random, nodes: int) -> tuple[list[int], list[int]]:
    parents, tokens = [], []
    for i in range(nodes):
        p = rng.choice([-1, *range(i)])
        taken = {tokens[j] for j in range(i) if parents[j] == p}
        tokens.append(rng.choice([t for t in range(4, 256) if t not in taken]))
        parents.append(p)
    return parents, tokens


def check_placements(engine, vocab: int, seed: int, context_len: int = 40) -> None:
    """A block's every row equals the decode of that token; the same block beside other sessions,
    and a tree's nodes, equal the decodes of their root paths: torch.equal, not a tolerance."""
    rng = random.Random(seed)
    context = [rng.randrange(4, vocab) for _ in range(context_len)]
    block = [rng.randrange(4, vocab) for _ in range(5)]
    singles = decoded(engine, context[:-1], [context[-1], *block[:-1]])
    # Inside a γ-block, alone.
    kv = cached(engine, context[:-1])
    engine.reserve(kv, 5)
    (alone,) = engine.forward([Feed(kv, [context[-1], *block[:-1]], scored=True)])
    engine.release(kv)
    # Inside the same block beside two other sessions (a longer block and a decode step).
    others = [cached(engine, [rng.randrange(4, vocab) for _ in range(n)]) for n in (17, 70)]
    kv = cached(engine, context[:-1])
    for seq, n in ((kv, 5), (others[0], 9), (others[1], 1)):
        engine.reserve(seq, n)
    batch = engine.forward([Feed(others[0], [7] * 9, scored=True), Feed(kv, [context[-1], *block[:-1]], scored=True),
                            Feed(others[1], [9], scored=True)])
    for seq in (kv, *others):
        engine.release(seq)
    for row, single in enumerate(singles):
        assert torch.equal(alone.logits[row], single), f"block row {row} differs from its decode"
        assert torch.equal(batch[1].logits[row], single), f"batched row {row} differs from its decode"
    # As nodes of a draft tree.
    parents, tokens = random_tree(rng, 9)
    kv = cached(engine, context[:-1])
    engine.reserve(kv, len(tokens) + 1)
    (tree,) = engine.forward([Feed(kv, [context[-1], *tokens], scored=True, parents=feed_parents(parents))])
    engine.release(kv)
    for node in range(len(tokens)):
        path = [tokens[n] for n in path_to(parents, node)]
        (chain,) = decoded(engine, context[:-1] + [context[-1]] + path[:-1], [path[-1]])
        assert torch.equal(tree.logits[node + 1], chain), f"tree node {node} differs from its chain"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_token_scores_the_same_bits_decoded_in_a_block_beside_others_and_in_a_tree(target, seed):
    check_placements(engine_for(target.model, 4096), target.vocab_size, seed)


@pytest.mark.embedded
@pytest.mark.slow
def test_the_embedded_target_scores_the_same_bits_wherever_a_token_sits():
    require_embedded()
    from hybridspec.common.models.embedded import default_paths
    from hybridspec.common.models.loading import load_model

    target = load_model(default_paths()["target"], device="cpu")
    check_placements(engine_for(target.model, 2048), target.vocab_size, seed=3, context_len=90)


def test_prefill_chunking_changes_no_bit_of_what_follows(target):
    engine = engine_for(target.model, 4096)
    rng = random.Random(4)
    context = [rng.randrange(4, 256) for _ in range(150)]
    results = []
    for chunk in (0, 1, 7, 64):
        kv = cached(engine, context, chunk)
        engine.reserve(kv, 3)
        (scores,) = engine.forward([Feed(kv, [11, 12, 13], scored=True)])
        engine.release(kv)
        results.append(scores.logits)
    assert all(torch.equal(results[0], other) for other in results[1:])


def test_scores_and_features_agree_with_hugging_face(target):
    engine = engine_for(target.model, 1024)
    ids = list(range(4, 60))
    kv = engine.new_sequence()
    engine.reserve(kv, len(ids))
    (scores,) = engine.forward([Feed(kv, ids, scored=True, features=True)])
    with torch.no_grad():
        ref = target.model(torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(scores.logits, ref.logits[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(scores.hidden, ref.hidden_states[-1][0], atol=1e-4, rtol=1e-4)


def test_a_qwen2_style_model_with_qkv_biases_is_served_exactly():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.normal_(param, std=0.5)  # biases that matter
    engine = engine_for(model, 1024)
    ids = list(range(4, 40))
    kv = cached(engine, ids[:-1])
    engine.reserve(kv, 1)
    (scores,) = engine.forward([Feed(kv, ids[-1:], scored=True)])
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(scores.logits[0], ref, atol=1e-4, rtol=1e-4)
    check_placements(engine, 256, seed=5)


def test_after_keep_rows_a_session_continues_as_if_its_path_were_a_chain(target):
    engine = engine_for(target.model, 2048)
    rng = random.Random(6)
    context = [rng.randrange(4, 256) for _ in range(30)]
    parents, tokens = [-1, -1, 0, 1, 3, 3], [10, 11, 12, 13, 14, 15]
    kv = cached(engine, context[:-1])
    engine.reserve(kv, len(tokens) + 1)
    engine.forward([Feed(kv, [context[-1], *tokens], scored=True, parents=feed_parents(parents))])
    path = path_to(parents, 5)
    engine.keep_rows(kv, len(context) - 1, [0, *(n + 1 for n in path)])
    engine.reserve(kv, 1)
    (after,) = engine.forward([Feed(kv, [77], scored=True)])
    (chain,) = decoded(engine, context + [tokens[n] for n in path], [77])
    assert torch.equal(after.logits[0], chain)


def test_random_weights_of_any_config_run_and_shapes_that_cannot_be_served_are_refused():
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256)
    engine = TorchEngine(random_weights(config, 256, torch.float32, "cpu"), 512)
    kv = cached(engine, [1, 2, 3])
    assert kv.length == 3 and engine.capabilities.max_sequence_tokens == 256
    sliding = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2,
                                           layer_types=["sliding_attention", "full_attention"]))
    with pytest.raises(ValueError, match="sliding"):
        engine_for(sliding, 512)


def test_the_row_floor_is_where_products_stop_depending_on_their_row_count():
    floor = row_floor([(48, 32), (96, 32)], 16, torch.float32)
    assert 1 <= floor <= 64
    x, w = torch.randn(64, 32), torch.randn(48, 32)
    full = torch.nn.functional.linear(x, w)
    for m in range(floor, 33):
        assert torch.equal(torch.nn.functional.linear(x[:m], w), full[:m])
