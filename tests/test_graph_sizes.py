"""Which CUDA graph a pass replays is a pure function of its size: the sizes captured are dense enough
that a verify pass of B sessions × (γ + 1) tokens pays for few padding rows, and the capture order
keeps the first engine's sizes when a budget cuts the list short (cloud/engine/torch_engine.py)."""
from __future__ import annotations

from hybridspec.cloud.engine.torch_engine import (GRAPH_TOKENS, GraphBudget, capture_order, graph_sizes,
                                                  padded_size, padding_waste)


def test_sizes_are_every_8_tokens_to_256_and_every_16_to_512():
    sizes = graph_sizes(512)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 512
    assert all(b - a <= 8 for a, b in zip(sizes[2:], sizes[3:]) if b <= 256)
    assert all(b - a <= 16 for a, b in zip(sizes, sizes[1:]) if a >= 256)
    assert len(sizes) == 3 + 32 + 16


def test_a_verify_pass_of_64_sessions_pays_for_its_own_rows_not_the_512_row_graph():
    sizes = graph_sizes(512)
    assert padded_size(64 * 5, sizes) == 320 and padding_waste(64 * 5, sizes) == 0.0
    assert padded_size(64 * 5, GRAPH_TOKENS) == 512 and padding_waste(64 * 5, GRAPH_TOKENS) == 0.375
    # At most 7 padding rows up to 256 tokens, 15 beyond (the first engine's sizes: up to 255).
    assert max(padded_size(t, sizes) - t for t in range(1, 257)) == 7
    assert max(padded_size(t, sizes) - t for t in range(257, 513)) == 15
    assert padded_size(513, sizes) is None and padding_waste(513, sizes) == 0.0  # eager, unpadded


def test_served_block_sizes_add_a_graph_for_every_batch_of_them():
    sizes = graph_sizes(512, blocks=(5, 3), graph_sessions=64)
    assert all(padding_waste(b * 5, sizes) == 0.0 for b in range(1, 65) if b * 5 <= 512)
    assert all(padding_waste(b * 3, sizes) == 0.0 for b in range(1, 65))
    assert max(sizes) == 512


def test_the_largest_is_captured_first_then_the_first_engines_sizes():
    order = capture_order(graph_sizes(512))
    assert order[0] == 512
    assert order[1:10] == [256, 128, 64, 32, 16, 8, 4, 2, 1]
    assert sorted(order) == list(graph_sizes(512))


def test_the_budget_stops_capture_at_its_count_time_or_memory_but_always_allows_one_graph():
    budget = GraphBudget(max_graphs=3, max_seconds=10.0, max_mib=100.0)
    assert budget.allows(0, 1e9, 1e9)
    assert budget.allows(2, 10.0, 100.0)
    assert not budget.allows(3, 0.0, 0.0)
    assert not budget.allows(1, 10.5, 0.0)
    assert not budget.allows(1, 0.0, 100.5)
