"""Pre-speculation's decision functions, against values worked out by hand."""

import math

import pytest
import torch

from specctl.draft.fanout import (
    carry_is_cheap,
    PRIOR_R, PRIOR_WEIGHT, acceptance_by_position, acceptance_estimate, answer_now, chain_outcome_probs, budget_that_fits, budget_that_pays, choose_fallback, expected_committed, expected_hit, fanout, hit_curve, fanout_for, outcome_probs,
    power_law_exponent, predicted_gain_over_plain, predicted_speedup, step_time_fit, tree_outcome_probs,
)
from specctl.spec.sampling import saguaro


def test_outcome_probabilities_are_geometric_and_capped():
    assert outcome_probs(0.5, 2) == [0.5, 0.25, 0.25]
    assert outcome_probs(0.0, 3) == [1.0, 0.0, 0.0, 0.0]
    assert math.isclose(sum(outcome_probs(0.73, 5)), 1.0)
    with pytest.raises(ValueError):
        outcome_probs(1.5, 2)


def test_fanout_follows_p_to_the_power_one_over_one_plus_r():
    # r = 0: shares 8 * [0.5, 0.25, 0.25]
    assert fanout(0.5, 0.0, 2, 8, 15) == [4, 2, 2]
    # r = 1: sqrt([0.5, 0.25, 0.25]) -> shares [3.31, 2.34, 2.34]; the one left over goes to k = 1
    assert fanout(0.5, 1.0, 2, 8, 15) == [3, 3, 2]


def test_tree_outcome_probabilities_split_a_node_among_its_children():
    assert tree_outcome_probs(0.5, [-1, 0, 1], [1.0, 0.9, 0.8]) == outcome_probs(0.5, 2)  # a chain
    # root -> 1 (q .6), 2 (q .3); 1 -> 3 (q .5); a = 0.6: node 1 accepted w.p. .6, node 2 .6 * .3 / .6 = .3
    # (the root keeps 1 - .9), node 3 .6 of node 1's .6
    assert tree_outcome_probs(0.6, [-1, 0, 0, 1], [1.0, 0.6, 0.3, 0.5]) == pytest.approx([0.1, 0.24, 0.3, 0.36])
    # two equally likely children at a = 0.9 would take 1.8: scaled to 0.99 together
    assert tree_outcome_probs(0.9, [-1, 0, 0], [1.0, 0.5, 0.5]) == pytest.approx([0.01, 0.495, 0.495])
    assert tree_outcome_probs(0.3, [-1], [1.0]) == [1.0]
    with pytest.raises(ValueError):
        tree_outcome_probs(0.5, [-1, 0], [1.0])


def test_fanout_for_a_tree_gives_each_node_its_share():
    # r = 0: 10 * [0.1, 0.24, 0.3, 0.36] = [1, 2.4, 3, 3.6]; the one left over goes to node 3 (remainder .6)
    assert fanout_for([0.1, 0.24, 0.3, 0.36], 0.0, 10, 15) == [1, 2, 3, 4]
    assert fanout_for([0.1, 0.24, 0.3, 0.36], 0.0, 10, 3) == [1, 3, 3, 3]  # capped: node 1 takes what 3 could not


def test_fanout_caps_a_position_and_gives_its_share_to_the_others():
    # a = 0.9, d = 1: shares [0.6, 5.4] of 6; k = 1 capped at 3, k = 0 takes the rest
    assert fanout(0.9, 0.0, 1, 10, 3) == [3, 3]
    assert fanout(0.9, 0.0, 1, 4, 3) == [1, 3]
    assert sum(fanout(0.7, 1.3, 4, 13, 15)) == 13
    assert fanout(0.7, 1.0, 3, 0, 15) == [0, 0, 0, 0]


def test_acceptance_estimate_starts_at_the_prior_and_follows_the_session():
    assert acceptance_estimate(0, 0) == pytest.approx(0.6)
    assert acceptance_estimate(90, 100) == pytest.approx((90 + 2.4) / 104)
    assert acceptance_estimate(0, 1000) == 0.01


def test_power_law_exponent_fits_the_miss_rate():
    # miss(2) = 1/2, miss(3) = 1/3: exactly F^-1
    ranks = [0] * 6 + [2] * 2 + [None] * 4
    assert power_law_exponent(ranks, 3) == pytest.approx(1.0)
    assert power_law_exponent(ranks[:7], 3) == PRIOR_R  # too few outcomes to fit
    assert power_law_exponent([0, 1] * 5, 3) == 8.0  # never missed with two candidates
    assert power_law_exponent([None] * 10, 3) == 0.05  # never among the candidates


def test_fallback_cross_over_from_measured_times():
    # JIT: 3 tokens / (0.1 + 4 * 0.05) = 10/s; n-gram: 1.2 / 0.1 = 12/s
    assert choose_fallback(4, 0.05, 4, 0.1, 3.0, 1.2) == "ngram"
    # a faster step: 3 / 0.14 = 21/s beats 12/s
    assert choose_fallback(4, 0.01, 4, 0.1, 3.0, 1.2) == "jit"
    with pytest.raises(ValueError):
        choose_fallback(0, 0.01, 4, 0.1, 3.0, 1.2)


def test_speedup_model():
    assert predicted_speedup(1.0, 3.0, 1.2, 0.5) == 3.0
    assert predicted_speedup(0.0, 3.0, 1.2, 0.5) == pytest.approx(1.2 / 1.5)
    # a full hit rate hides the draft time entirely: E_p / 1 over E_p / (1 + T_p)
    assert predicted_gain_over_plain(1.0, 3.0, 1.0) == pytest.approx(2.0)
    assert predicted_gain_over_plain(0.0, 3.0, 1.0) == pytest.approx(1.0)


def test_a_draft_slower_than_the_verification_bounds_a_hits_round_by_its_own_time():
    # SSD assumes T_p <= 1; a draft taking 1.5 verifications makes a hit's round 1.5, not 1
    assert predicted_speedup(1.0, 3.0, 3.0, 1.5, t_primary=1.5) == pytest.approx(3.0 / 1.5)
    assert predicted_gain_over_plain(1.0, 3.0, 1.5) == pytest.approx(2.5 / 1.5)
    assert predicted_gain_over_plain(0.5, 3.0, 1.5) == pytest.approx(2.5 / (0.5 * 1.5 + 0.5 * 2.5))
    # at T_p <= 1 Theorem 7 as SSD states it
    assert predicted_gain_over_plain(0.5, 3.0, 0.8) == pytest.approx(1.8 / (0.5 + 0.5 * 1.8))


def test_saguaro_sampling_down_weights_the_top_f_plus_one():
    q = torch.tensor([0.4, 0.3, 0.2, 0.1])
    expected = torch.tensor([0.2, 0.15, 0.2, 0.1]) / 0.65
    assert torch.allclose(saguaro(q, 1, 0.5), expected)
    assert saguaro(q, 1, 1.0) is q
    with pytest.raises(ValueError):
        saguaro(q, 1, 0.0)


def test_step_time_is_fitted_linear_in_rows():
    alpha, beta = step_time_fit([(1, 0.02), (3, 0.04), (5, 0.06)])
    assert alpha == pytest.approx(0.01) and beta == pytest.approx(0.01)
    assert step_time_fit([(4, 0.05), (4, 0.06)]) is None  # rows never varied: no slope
    assert step_time_fit([(2, 0.03)]) is None


def test_budget_is_what_finishes_before_the_outcome_returns():
    fit = (0.01, 0.01)  # 10 ms + 10 ms per row
    # Z = 350 ms over d+1 = 5 steps: 70 ms a step -> 6 rows
    assert budget_that_fits(0.35, 4, fit, sharing=1, most=8) == 6
    assert budget_that_fits(0.35, 4, fit, sharing=2, most=8) == 3  # two sessions share the steps
    assert budget_that_fits(0.35, 4, fit, sharing=1, most=4) == 4
    assert budget_that_fits(0.01, 4, fit, sharing=1, most=8) == 1  # at least the likeliest outcome


def test_expected_hit_weighs_each_outcome_by_the_share_of_past_bonuses_its_fanout_covers():
    # ranks [0, 1, 3, None]: H(2) = 2/4, H(1) = 1/4, H(0) = 0 -> 0.5 * 0.5 + 0.3 * 0.25 + 0.2 * 0
    assert expected_hit([0.5, 0.3, 0.2], [2, 1, 0], hit_curve([0, 1, 3, None])) == pytest.approx(0.325)
    assert expected_hit([0.5, 0.5], [4, 4], hit_curve([])) == 0.0  # nothing ranked yet
    with pytest.raises(ValueError, match="one fan-out per outcome"):
        expected_hit([0.5, 0.5], [1], hit_curve([0]))


def test_budget_that_pays_counts_partly_drafted_hits():
    # 30 ms + 3 ms per row, Z = 100 ms, d = 3: a just-in-time proposal costs 4 * 33 ms = 132 ms.
    # B=1: step 33 ms, share 100/132 = 0.758: 0.2 * 0.758 * 132 - 16.5 = 3.5 ms saved
    # B=2: step 36 ms, share 0.694: 0.4 * 0.694 * 132 - 18 = 18.7 ms
    # B=3: step 39 ms, share 0.641: 0.5 * 0.641 * 132 - 19.5 = 22.8 ms   <- the most
    # B=4: step 42 ms, share 0.595: 0.55 * 0.595 * 132 - 21 = 22.2 ms
    hits = {1: 0.2, 2: 0.4, 3: 0.5, 4: 0.55}
    fit = (0.030, 0.003)
    assert budget_that_pays(0.100, 3, fit, sharing=1, most=4, hit_at=hits.get) == 3
    assert budget_that_fits(0.100, 3, fit, sharing=1, most=4) == 1  # no branch would finish in time
    # Three sessions share each step (steps of 39, 48, 57, 66 ms): B=1 -2.6 ms, B=2 3.5 ms, B=3 0.5 ms, B=4 -5.5 ms
    assert budget_that_pays(0.100, 3, fit, sharing=3, most=4, hit_at=hits.get) == 2
    # Four: every budget costs more than it saves; the least loss is B=2 (-2.6 ms against -5.3 at B=1)
    assert budget_that_pays(0.100, 3, fit, sharing=4, most=4, hit_at=hits.get) == 2
    # Batching for free and time to spare: the largest budget; hits that do not grow with B: the smallest.
    assert budget_that_pays(1.0, 3, (0.030, 1e-9), sharing=1, most=4, hit_at=hits.get) == 4
    assert budget_that_pays(0.100, 3, fit, sharing=1, most=4, hit_at=lambda b: 0.3) == 1
    with pytest.raises(ValueError, match="most >= 1"):
        budget_that_pays(0.1, 3, fit, sharing=1, most=0, hit_at=hits.get)


def test_expected_committed_counts_the_accepted_tokens_and_the_bonus():
    assert expected_committed([0.75] * 4, 4) == pytest.approx(1 + 0.75 + 0.5625 + 0.421875 + 0.31640625)
    assert expected_committed([0.5], 0) == 1.0  # nothing drafted: the bonus alone
    assert expected_committed([1.0] * 3, 3) == 4.0
    # by position: 1 + .7 + .7 * .9 + .7 * .9 * .9
    assert expected_committed([0.7, 0.9, 0.9, 0.5], 3) == pytest.approx(1 + 0.7 + 0.63 + 0.567)
    with pytest.raises(ValueError):
        expected_committed([1.5, 0.5], 2)
    with pytest.raises(ValueError):
        expected_committed([0.5], 2)  # more drafted than positions known


def test_acceptance_by_position_is_measured_per_position_and_pulled_towards_a_while_unseen():
    assert acceptance_by_position([], 3, 0.6) == pytest.approx([0.6, 0.6, 0.6])
    # d = 2 rounds (proposed, accepted): position 1 reached 5 times, accepted 4; position 2 reached
    # 3 times, accepted 2 (the round of one token says nothing about it), pulled towards p_1
    rounds = [(2, 2), (2, 0), (2, 1), (1, 1), (2, 2)]
    w = PRIOR_WEIGHT
    p1 = (4 + 0.5 * w) / (5 + w)
    assert acceptance_by_position(rounds, 2, 0.5) == pytest.approx([p1, (2 + p1 * w) / (3 + w)])
    # never reached: as likely as the position before it
    assert acceptance_by_position([(1, 1)] * 50, 3, 0.5)[1:] == pytest.approx([(50 + 0.5 * w) / (50 + w)] * 2)
    # streaks: every round all or nothing — position 1 is a coin flip, the later ones always follow
    streaks = [(4, 4), (4, 0)] * 200
    p = acceptance_by_position(streaks, 4, 0.5)
    assert p[0] == pytest.approx(0.5) and min(p[1:]) > 0.98
    assert chain_outcome_probs(p)[4] > 0.45  # where a geometric P(k) in a = 0.5 says 0.0625
    with pytest.raises(ValueError):
        acceptance_by_position(rounds, 0, 0.5)


def test_chain_outcome_probabilities_follow_the_acceptance_by_position():
    assert chain_outcome_probs([0.5, 0.5]) == outcome_probs(0.5, 2) == [0.5, 0.25, 0.25]
    assert chain_outcome_probs([0.8, 0.9]) == pytest.approx([0.2, 0.08, 0.72])
    with pytest.raises(ValueError):
        chain_outcome_probs([])


def test_a_partly_drafted_hit_is_answered_now_when_waiting_commits_fewer_tokens_a_second():
    # p = 0.75 at every position, d = 4, Z = 0.5 s, a step 0.12 s: E(4) = 3.0508 over 0.5 + (4 - j)·0.12
    a = [0.75] * 4
    assert answer_now(3, 4, a, 0.5, 0.12)  # 2.7344 / 0.5 = 5.47/s against 3.0508 / 0.62 = 4.92/s
    assert answer_now(2, 4, a, 0.5, 0.12)  # 2.3125 / 0.5 = 4.63/s against 3.0508 / 0.74 = 4.12/s
    assert not answer_now(1, 4, a, 0.5, 0.12)  # 1.75 / 0.5 = 3.5/s against 3.0508 / 0.86 = 3.55/s
    assert not answer_now(3, 4, a, 0.5, 0.01)  # a fast step: 3.0508 / 0.51 = 5.98/s against 5.47/s
    assert not answer_now(4, 4, a, 0.5, 0.12)  # done: nothing to wait for
    # A 0.1 s step: at p = 0.75 throughout, 2.7344 / 0.5 = 5.47/s now against 3.0508 / 0.6 = 5.08/s; in
    # streaks (p = .6, .99, .99, .99: a round that starts well goes on) E(3) = 2.7821, E(4) = 3.3642,
    # 5.56/s now against 5.61/s after one more step: wait
    assert answer_now(3, 4, a, 0.5, 0.1)
    assert not answer_now(3, 4, [0.6, 0.99, 0.99, 0.99], 0.5, 0.1)
    for bad in [(0, 4, a, 0.5, 0.1), (5, 4, a, 0.5, 0.1), (2, 4, a, 0.0, 0.1), (2, 4, a, 0.5, -1.0), (2, 4, a[:3], 0.5, 0.1)]:
        with pytest.raises(ValueError):
            answer_now(*bad)



def test_carried_rows_must_add_at_most_a_tenth_to_a_forward():
    gpu_like, cpu_like = (0.120, 1e-6), (0.002, 0.004)  # seconds: fixed, per row
    assert carry_is_cheap(gpu_like, 1, 40)  # 40 rows add 0.03 % to a 120 ms step
    assert not carry_is_cheap(cpu_like, 1, 40)  # 160 ms on a 6 ms step
    assert carry_is_cheap((0.1, 0.001), 1, 10) and not carry_is_cheap((0.1, 0.001), 1, 11)  # 10.1 ms of 101 ms
    assert carry_is_cheap((0.0, 0.001), 20, 2) and not carry_is_cheap((0.0, 0.001), 20, 3)  # own rows count
    assert not carry_is_cheap(None, 1, 5)  # not measured yet
    assert not carry_is_cheap(gpu_like, 1, 0)  # nothing to carry
