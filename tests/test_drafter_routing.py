"""Routing among drafters (CoSine) and fusion of their chains, as pure functions, by hand."""

import pytest

from specctl.spec.fusion import Draft, accepted_prefix, fuse, fuse_chains, own_path, routing_outcome
from specctl.spec.routing import (PRIOR, RoutingPolicy, RoutingScore, choose_drafters, next_drafter, rank_drafters,
                                  token_score)


def test_token_score_by_hand():
    assert token_score(0.8, 1.0) == pytest.approx(1.0)  # 0.8 / (0.8 + 0)
    assert token_score(0.8, 0.0) == 0.0  # 0 / (0 + 0.2)
    assert token_score(0.8, 0.5) == pytest.approx(0.8)  # 0.4 / (0.4 + 0.1)
    assert token_score(0.3, 0.6) == pytest.approx(0.18 / (0.18 + 0.28))
    assert token_score(1.0, 0.0) == 0.0 and token_score(0.0, 1.0) == 0.0  # 0/0 -> 0


def test_running_score_is_the_mean_over_proposed_tokens():
    score = RoutingScore()
    assert score.value == PRIOR
    score.add([0.9, 0.7, 0.4], accepted=2)  # 1 + 1 + 0
    score.add([0.6], accepted=0)  # 0
    assert score.tokens == 4 and score.value == pytest.approx(0.5)


def test_choose_explores_below_tau_and_exploits_above():
    policy = RoutingPolicy(tau=2.0, alpha=0.5, beta=0.1)
    scores = [0.2, 0.9, 0.5]
    up = [True, True, True]
    # exploring (mean accepted 1.0 < 2): a coin under alpha adds a random other drafter
    assert choose_drafters(scores, up, 1.0, policy, coin=0.3, pick=0.0) == [1, 0]
    assert choose_drafters(scores, up, 1.0, policy, coin=0.3, pick=0.99) == [1, 2]
    assert choose_drafters(scores, up, 1.0, policy, coin=0.6, pick=0.0) == [1]
    # exploiting (3.0 >= 2): only a coin under beta adds one
    assert choose_drafters(scores, up, 3.0, policy, coin=0.3, pick=0.0) == [1]
    assert choose_drafters(scores, up, 3.0, policy, coin=0.05, pick=0.5) == [1, 2]


def test_choose_skips_drafters_that_are_down_and_breaks_ties_by_order():
    policy = RoutingPolicy()
    assert choose_drafters([0.5, 0.9], [True, False], 0.0, policy, 0.0, 0.0) == [0]
    assert choose_drafters([0.5, 0.9], [False, False], 0.0, policy, 0.0, 0.0) == []
    assert choose_drafters([0.5, 0.5, 0.5], [True] * 3, 5.0, policy, 0.9, 0.0) == [0]


def test_free_drafters_win_ties_and_ride_along():
    free = [False, False, True]
    # all untried (0.5): the free n-gram lookup is ranked first
    assert rank_drafters([0.5, 0.5, 0.5], [True] * 3, free) == [2, 0, 1]
    assert choose_drafters([0.5, 0.5, 0.5], [True] * 3, 0.0, RoutingPolicy(), 0.9, 0.0, free) == [2]
    # a model drafter scoring higher is asked, and the free one joins the fusion ...
    assert choose_drafters([0.5, 0.8, 0.3], [True] * 3, 0.0, RoutingPolicy(), 0.9, 0.0, free) == [1, 2]
    assert choose_drafters([0.5, 0.8, 0.3], [True] * 3, 0.0, RoutingPolicy(), 0.1, 0.0, free) == [1, 0, 2]
    # ... unless one drafter a round is asked for, or it is down
    one = RoutingPolicy(alpha=0.0, beta=0.0, free_riders=False)
    assert choose_drafters([0.5, 0.8, 0.3], [True] * 3, 0.0, one, 0.0, 0.0, free) == [1]
    assert choose_drafters([0.5, 0.8, 0.3], [True, True, False], 0.0, RoutingPolicy(), 0.9, 0.0, free) == [1]


def test_next_drafter_is_the_best_ranked_not_asked():
    free = [False, False, True]
    assert next_drafter([0.5, 0.8, 0.9], [True] * 3, [2], free) == 1
    assert next_drafter([0.5, 0.8, 0.9], [True, False, True], [2], free) == 0
    assert next_drafter([0.5, 0.8, 0.9], [True, False, True], [2, 0], free) is None


def test_policy_is_checked():
    with pytest.raises(ValueError, match="need 0 <= beta <= alpha <= 1"):
        RoutingPolicy(alpha=0.1, beta=0.5)
    with pytest.raises(ValueError, match="tau must be >= 0"):
        RoutingPolicy(tau=-1)


def test_fusion_merges_shared_prefixes_and_orders_siblings_by_confidence():
    tree, nodes = fuse_chains(7, [([1, 2, 3], [0.6, 0.5, 0.4]), ([1, 4], [0.9, 0.8]), ([5], [0.7])], budget=10)
    # root 7; level 1: 1 (conf max(0.6, 0.9)) before 5 (0.7); level 2 under 1: 4 (0.8) before 2 (0.5); then 3
    assert tree.tokens == [7, 1, 5, 4, 2, 3]
    assert tree.parents == [-1, 0, 0, 1, 1, 4]
    assert tree.probs == pytest.approx([1.0, 0.9, 0.7, 0.8, 0.5, 0.4])
    assert nodes == [[1, 4, 5], [1, 3], [2]]


def test_fusion_respects_the_budget_best_chain_first():
    tree, nodes = fuse_chains(0, [([1, 2, 3], [0.9] * 3), ([1, 5, 6], [0.8] * 3)], budget=4)
    assert len(tree) == 5 and tree.tokens == [0, 1, 2, 5, 3]
    assert nodes == [[1, 2, 4], [1, 3]]  # the second chain was cut after 5
    empty, none = fuse_chains(9, [([], [])], budget=3)
    assert empty.tokens == [9] and none == [[]]
    with pytest.raises(ValueError, match="budget must be >= 0"):
        fuse_chains(0, [], -1)


def test_accepted_prefix():
    assert accepted_prefix([1, 3, 5], [1, 3, 4]) == 2
    assert accepted_prefix([2], [1, 3]) == 0
    assert accepted_prefix([1, 3], [1, 3, 5]) == 2
    assert accepted_prefix([], [1]) == 0


def test_fusion_merges_a_tree_with_a_chain_and_maps_each_drafts_nodes():
    #   tree draft: root -> 1 (0.6) -> 3 (0.5); root -> 2 (0.3) -> 4 (0.2), 5 (0.25)
    tree_draft = Draft([1, 2, 3, 4, 5], [0, 0, 1, 2, 2], [0.6, 0.3, 0.5, 0.2, 0.25])
    chain = Draft.chain([2, 4, 9], [0.9, 0.8, 0.7])
    tree, (tree_where, chain_where) = fuse(7, [tree_draft, chain], budget=10)
    # level 1: 2 (max 0.3, 0.9) before 1 (0.6); level 2 under 2: 4 (0.8) then 5 (0.25); under 1: 3; then 9 under 4
    assert tree.tokens == [7, 2, 1, 4, 5, 3, 9]
    assert tree.parents == [-1, 0, 0, 1, 1, 2, 3]
    assert tree_where == [2, 1, 5, 3, 4] and chain_where == [1, 3, 6]
    # the target accepts 2, 4, 9: the tree drafter's own nodes 2, 4; the chain's 1, 2, 3
    assert own_path([1, 3, 6], tree_where) == [2, 4] and own_path([1, 3, 6], chain_where) == [1, 2, 3]
    assert own_path([2, 5], chain_where) == []
    # its nodes on the path accepted, its likeliest line below them rejected (none below 4)
    assert routing_outcome(tree_draft, tree_where, [2, 4]) == ([0.3, 0.2], 2)
    assert routing_outcome(tree_draft, tree_where, []) == ([0.6, 0.5], 0)  # nothing taken: its best line
    assert routing_outcome(chain, chain_where, [1]) == ([0.9, 0.8, 0.7], 1)


def test_fusion_cuts_a_trees_subtree_with_its_parent():
    tree_draft = Draft([1, 2, 3, 4], [0, 0, 1, 2], [0.9, 0.8, 0.7, 0.6])
    tree, (where,) = fuse(0, [tree_draft], budget=2)
    assert tree.tokens == [0, 1, 2] and where == [1, 2, None, None]
    assert routing_outcome(tree_draft, where, []) == ([0.9], 0)  # a cut node is not counted
    with pytest.raises(ValueError, match="parents must come before their children"):
        Draft([1, 2], [0, 2], [0.5, 0.5])
    with pytest.raises(ValueError, match="one parent and one confidence per token"):
        Draft([1, 2], [0], [0.5, 0.5])
