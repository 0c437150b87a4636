"""Sizing draft trees (edge/tree_policy.py) and reading a tree verdict on the edge (edge/proposal.py)."""
from __future__ import annotations

import itertools
import math

import pytest

from hybridspec.common.protocol.errors import Internal
from hybridspec.common.protocol.wire import VerifyResult
from hybridspec.edge import policy, tree_policy
from hybridspec.edge.estimates import Estimates
from hybridspec.edge.proposal import Proposal


def brute_best(ranks: list[float], nodes: int, depth: int) -> float:
    """1 + the `nodes` largest path products over every rank sequence of at most `depth` levels."""
    products = [math.prod(ranks[r] for r in seq)
                for d in range(1, depth + 1) for seq in itertools.product(range(len(ranks)), repeat=d)]
    return 1 + sum(sorted(products, reverse=True)[:nodes])


@pytest.mark.parametrize("ranks", [[0.6, 0.2, 0.1], [0.4, 0.15, 0.1, 0.05], [0.9, 0.05], [0.3, 0.3, 0.3]])
@pytest.mark.parametrize("nodes, depth", [(1, 1), (4, 3), (8, 4), (16, 4), (30, 3)])
def test_best_tree_takes_the_most_probable_nodes(ranks, nodes, depth):
    expected, shape = tree_policy.best_tree(ranks, nodes, depth)
    assert expected == pytest.approx(brute_best(ranks, nodes, depth))
    assert shape.nodes <= nodes and shape.depth <= depth and shape.top_k <= len(ranks)


def test_a_one_choice_tree_is_the_chain():
    alpha = 0.7
    for n in range(1, 9):
        expected, shape = tree_policy.best_tree([alpha], n, n)
        assert shape == tree_policy.Shape(n, n, 1) and shape.is_chain
        assert expected == pytest.approx(policy.expected_tokens([alpha] * n, n))


def rates(verify_flat: bool) -> policy.Rates:
    curve = [0.010] * 70 if verify_flat else [0.010 * (1 + g) for g in range(70)]
    return policy.Rates(alphas=[0.5] * 9, draft_s=0.0002, rtt_s=0.02, verify_single_s=0.01, verify_block_s=0.01,
                        verify_per_draft_s=0.0, cloud_token_s=0.01, verify_curve_s=curve)


def test_cheap_verification_buys_wide_trees_and_costly_verification_small_ones():
    ranks = [0.45, 0.15, 0.08, 0.05]
    _, wide = tree_policy.choose_tree(rates(verify_flat=True), ranks, 64, 8, 4)
    _, narrow = tree_policy.choose_tree(rates(verify_flat=False), ranks, 64, 8, 4)
    assert wide.nodes >= 16 and wide.top_k > 1
    assert narrow.nodes <= 8


def test_rank_estimates_follow_what_is_observed():
    est = Estimates(8)
    for _ in range(60):
        est.observe_ranks([1, 1, 2, None])
    r = est.ranks  # decayed: the latest of each period of four weighs most, hence the tolerance
    assert r[0] == pytest.approx(0.5, abs=0.06) and r[1] == pytest.approx(0.25, abs=0.03) and sum(r[2:]) < 0.01


TREE = Proposal([10, 11, 12, 13], None, False, parents=(-1, -1, 1, 1),
                ranked=[(10, 11, 5), (10, 11, 5), (12, 13, 6), (12, 13, 6)])


@pytest.mark.parametrize("num, path", [(2, (0, 2)), (1, (2,)), (3, (1, 2, 3)), (1, (9,)), (0, (1,))])
def test_a_verdict_naming_a_path_not_in_the_tree_commits_nothing(num, path):
    with pytest.raises(Internal):
        TREE.accepted(VerifyResult(0, num, 7, 9, accepted_path=path))


def test_a_tree_verdict_gives_nodes_ranks_and_origins():
    result = VerifyResult(0, 2, 6, 9, accepted_path=(1, 3))
    nodes = TREE.accepted(result)
    assert nodes == [1, 3] and TREE.is_leaf(nodes)
    assert TREE.ranks_seen(nodes, 6) == [2, 2]  # the leaf's rank after it is unknown
    assert TREE.ranks_seen([1], 6) == [2, 3]  # node 1's children were ranked (12, 13, 6)
    assert TREE.main_nodes() == [0] and TREE.main_path().ids == [10]
    with pytest.raises(Internal):
        Proposal([1, 2], None, False).accepted(VerifyResult(0, 3, 7, 9))
