"""The n-gram (prompt lookup) drafter's proposals, exactly."""

from specctl.spec.drafters import NgramDrafter
from specctl.spec.params import SamplingParams


def test_the_latest_occurrence_with_a_full_continuation_is_proposed():
    # "1 2" occurs at 0 (followed by 3 4 5) and at 5 (followed by 9 8 7): the latest wins
    assert NgramDrafter(3, max_ngram=2).lookup([1, 2, 3, 4, 5, 1, 2, 9, 8, 7, 1, 2]) == [9, 8, 7]


def test_a_loop_proposes_a_full_depth_not_the_one_token_after_the_latest_match():
    assert NgramDrafter(4).lookup([5, 6] + [7] * 8) == [7, 7, 7, 7]
    assert NgramDrafter(5, max_ngram=2).lookup([3, 1, 2, 1, 2, 1, 2, 1, 2]) == [1, 2, 1, 2, 1]


def test_with_no_full_continuation_the_longest_is_proposed():
    # "4 4" at 2 is followed by 1 4 4, at 1 by 4 1 4 4: neither by 5 tokens, the longer wins
    assert NgramDrafter(5, max_ngram=2).lookup([0, 4, 4, 4, 1, 4, 4]) == [4, 1, 4, 4]


def test_the_longest_ngram_is_tried_first_and_no_match_proposes_nothing():
    # the 3-gram "2 3 4" matches at 1 (-> 8); the 1-gram "4" alone would match later (-> 6)
    assert NgramDrafter(1).lookup([1, 2, 3, 4, 8, 4, 6, 2, 3, 4]) == [8]
    assert NgramDrafter(4).lookup([1, 2, 3, 4]) == []
    assert NgramDrafter(4).lookup([7]) == []


def test_a_session_proposes_the_lookup_as_a_chain_under_the_last_token():
    session = NgramDrafter(3).open(64)
    proposal = session.propose([1, 2, 3, 1, 2], SamplingParams(), None)
    assert proposal.tree.tokens.tolist() == [2, 3, 1, 2]
    assert proposal.tree.parents.tolist() == [-1, 0, 1, 2]


def test_a_capped_session_looks_up_at_most_its_cap_and_may_find_a_later_occurrence():
    # "1 2" at 5 is followed by two tokens before the end: too few for 3, enough for a cap of 2
    seq = [1, 2, 3, 4, 5, 1, 2, 1, 2]
    drafter = NgramDrafter(3, max_ngram=2)
    assert drafter.lookup(seq) == [3, 4, 5] and drafter.lookup(seq, 2) == [1, 2]
    session = NgramDrafter(3, max_ngram=2).open(64)
    session.depth_cap = 2
    assert session.propose(seq, SamplingParams(), None).tree.tokens.tolist() == [2, 1, 2]
    session.depth_cap = 0
    assert session.propose(seq, SamplingParams(), None).tree.tokens.tolist() == [2, 3, 4, 5]
