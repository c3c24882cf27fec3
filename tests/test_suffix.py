"""Suffix decoding (spec.suffix): Arctic's draft from the continuations of the context's
longest earlier matches, in the session's own text and every session's output; hand-checked
trees, freed state, and the target's own output whatever it proposes."""

import pytest

from specctl.spec.rounds import generate, run_to_end
from specctl.spec.params import SamplingParams
from specctl.spec.suffix import SequenceIndex, SuffixDrafter, grow, proposal_tree, speculate

OUTPUTS = [[9, 1, 2, 3, 4], [8, 1, 2, 3, 5], [7, 1, 2, 6]]


def indexed(sequences):
    index = SequenceIndex()
    for number, sequence in enumerate(sequences):
        index.extend(number, sequence)
    return index


def test_the_tree_takes_the_likeliest_nodes_first_with_arctics_counts():
    """After (1, 2): 3 in two of three occurrences, 6 in one; after 3: 5 (the newer) and 4.
    A node's probability is its share of its parent's occurrences times the parent's."""
    found = indexed(OUTPUTS).occurrences((1, 2))
    assert [end for _, end in found] == [2, 2, 2] and found[0][0].tolist() == OUTPUTS[2]  # the latest written first
    third = 1 / 3
    assert grow(found, 4, 0.1, tree=True) == ([3, 6, 5, 4], [-1, -1, 0, 0], [2 * third, third, third, third])
    assert grow(found, 2, 0.1, tree=True) == ([3, 6], [-1, -1], [2 * third, third])
    assert grow(found, 4, 0.1, tree=False) == ([3, 5], [-1, 0], [2 * third, third])  # a chain: the likeliest child
    assert grow(found, 4, 0.4, tree=True) == ([3], [-1], [2 * third])  # under min_token_prob: left out


def test_a_level_cap_spends_the_budget_on_the_levels_it_keeps():
    """The target's load asks for at most one level: the budget goes to the first level's
    likeliest nodes (3 and 6), not below them; a chain stops at the cap."""
    found = indexed(OUTPUTS).occurrences((1, 2))
    third = 1 / 3
    assert grow(found, 4, 0.1, tree=True, max_levels=1) == ([3, 6], [-1, -1], [2 * third, third])
    assert grow(found, 4, 0.1, tree=True, max_levels=2) == ([3, 6, 5, 4], [-1, -1, 0, 0], [2 * third] + [third] * 3)
    assert grow(found, 4, 0.1, tree=False, max_levels=1) == ([3], [-1], [2 * third])
    assert speculate([9, 1, 2], found, 8, max_levels=1) == ([3], [-1], [1.0])


def test_a_session_keeps_to_the_cap_the_target_asks_for():
    """A suffix session's proposal at most its cap deep (set as DraftState.cap_depth sets it),
    and as deep as before once the cap is lifted."""
    session = SuffixDrafter(8, max_spec_factor=4.0).open(64)  # a 2-token match may draft 8
    text = [5, 6, 7, 8, 9, 10, 11, 5, 6]
    assert session.propose(text, SamplingParams(), None).tree.tokens.tolist() == [6, 7, 8, 9, 10, 11, 5, 6]
    session.depth_cap = 2
    assert session.propose(text, SamplingParams(), None).tree.tokens.tolist() == [6, 7, 8]
    session.depth_cap = 0
    assert session.propose(text, SamplingParams(), None).tree.max_depth == 7
    assert session.plain_draft(text, 3).tokens == [6, 7, 8, 9]  # a fused target's suffix link asks so


def test_the_longest_match_wins_when_its_probabilities_sum_higher():
    """Context (0, 1, 2) matches all three by 2 tokens: 2 nodes at most (m x factor). (9, 1, 2)
    matches the first by 3: its run, 3 then 4, sums 2.0 and beats the 2-token match's 1.0."""
    found = indexed(OUTPUTS).occurrences((1, 2))
    assert speculate([0, 1, 2], found, 8) == ([3, 6], [-1, -1], [2 / 3, 1 / 3])
    assert speculate([9, 1, 2], found, 8) == ([3, 4], [-1, 0], [1.0, 1.0])
    assert speculate([9, 1, 2], found, 1) == ([3], [-1], [1.0])  # depth caps it
    assert speculate([0, 1, 2], found, 8, max_spec_factor=2.0) == ([3, 6, 5, 4], [-1, -1, 0, 0],
                                                                  [2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert speculate([5, 5], found, 8) == ([], [], [])


def test_a_best_first_draft_becomes_a_breadth_first_tree_with_probabilities_given_the_parent():
    tree = proposal_tree(2, [3, 6, 5, 4], [-1, -1, 0, 0], [2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert tree.tokens == [2, 3, 6, 5, 4] and tree.parents == [-1, 0, 0, 1, 1]
    assert tree.probs == pytest.approx([1.0, 2 / 3, 1 / 3, 0.5, 0.5])
    deep = proposal_tree(7, [3, 4, 6], [-1, 0, -1], [0.9, 0.9, 0.1])  # a grandchild taken before an uncle
    assert deep.tokens == [7, 3, 6, 4] and deep.parents == [-1, 0, 0, 1]


def test_dropping_a_sequence_leaves_no_index_entry_of_it():
    index = indexed(OUTPUTS)
    index.drop(1)
    assert 1 not in index.sequences
    assert all(entry >> 32 != 1 for entries in index.positions.values() for entry in entries)
    assert [end for _, end in index.occurrences((1, 2))] == [2, 2]
    index.drop(0), index.drop(2)
    assert index.sequences == {} and index.positions == {}


def test_the_drafter_keeps_only_the_last_outputs_and_a_closed_session_frees_its_text():
    drafter = SuffixDrafter(4, max_cached=3)
    for number in range(1000):
        session = drafter.open(64)
        prompt = [number % 7, 1, 2]
        session.propose(prompt + [number % 5], SamplingParams(), None)
        session.propose(prompt + [number % 5, 3, 4], SamplingParams(), None)
        session.close()
        assert session.text.sequences == {} and session.text.positions == {}
    assert list(drafter.outputs.sequences) == [997, 998, 999]
    # each output is kept after its prompt's last token (KEY - 1 = 1 of them)
    assert drafter.outputs.sequences[999].tolist() == [2, 4, 3, 4]
    live = {entry >> 32 for entries in drafter.outputs.positions.values() for entry in entries}
    assert live == {997, 998, 999}
    drafter.forget()
    assert drafter.outputs.sequences == {}


def test_a_profiles_suffix_options_reach_the_drafter(tmp_path):
    from specctl.config import build_config
    from specctl.spec.factory import make_drafter

    profile = tmp_path / "suffix.toml"
    profile.write_text("mode = 'suffix'\ndepth = 12\nsuffix_max_spec_factor = 2.5\nsuffix_min_token_prob = 0.3\n"
                       "suffix_max_depth = 32\nsuffix_max_cached = 7\n")
    drafter = make_drafter(build_config(str(profile)), None)
    assert isinstance(drafter, SuffixDrafter)
    assert (drafter.depth, drafter.max_spec_factor, drafter.min_token_prob, drafter.max_depth, drafter.max_cached,
            drafter.max_nodes) == (12, 2.5, 0.3, 32, 7, 13)


def test_a_session_draws_on_its_own_text_but_not_its_end():
    drafter = SuffixDrafter(4)
    session = drafter.open(64)
    proposal = session.propose([5, 6, 7, 8, 5, 6], SamplingParams(), None).tree
    assert proposal.tokens.tolist() == [6, 7, 8]  # after the earlier (5, 6): 7, 8 — the end itself is no occurrence
    assert proposal.probs.tolist() == [1.0, 1.0, 1.0]  # (with it, each would be halved)
    alone = drafter.open(64).propose([1, 2], SamplingParams(), None).tree
    assert alone.tokens.tolist() == [2]  # nothing matches: the root alone, the round is plain AR


@pytest.mark.parametrize("arch", ["llama", "qwen2", "deepseek_v3"])
def test_greedy_output_is_the_targets_and_a_repeated_request_is_drafted_from_the_first(tiny, arch):
    """The second run of a prompt finds the first run's output: nearly every token is drafted
    and accepted, and the output is the target alone's, as every other run's."""
    target = tiny[arch]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    drafter = SuffixDrafter(6)
    prompts = [[3, 17, 42, 99, 5], [7, 8, 9, 10] * 6, [3, 17, 42, 99, 6]]
    for prompt in prompts:
        reference, _, _ = generate(target, prompt, params)
        first = run_to_end(target, prompt, params, drafter)
        again = run_to_end(target, prompt, params, drafter)
        assert first.output == again.output == reference, prompt
        assert again.stats.accepted >= max(24, first.stats.accepted), (first.stats.accepted, again.stats.accepted)
        # the whole output is remembered, the last round's tokens (which no proposal followed) too
        assert drafter.outputs.sequences[max(drafter.outputs.sequences)].tolist() == prompt[-1:] + again.output


def test_a_multi_drafter_s_suffix_session_learns_the_rounds_it_was_not_asked_in():
    from specctl.spec.drafters import NgramDrafter
    from specctl.spec.multi import MultiDrafter

    suffix = SuffixDrafter(4)
    session = MultiDrafter({"ngram": NgramDrafter(4), "suffix": suffix}, budget=8).open(64)
    session.observe([9, 1, 2, 3])  # the prompt [9, 1, 2] and the prefill's token
    session.observe([9, 1, 2, 3, 4, 5])  # rounds in which only the n-gram lookup drafted
    session.close()
    assert suffix.outputs.sequences[0].tolist() == [2, 3, 4, 5]  # the output after the prompt's last token
