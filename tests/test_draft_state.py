"""DraftState: the one place an outcome is applied to the draft side, and where an outcome
that the last proposal could not have had is refused before it reaches the model."""

import pytest

from specctl.errors import BadRequest
from specctl.spec.draft_state import DraftState, draft_capacity, draft_many
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, Proposal
from specctl.spec.params import SamplingParams

import torch


def _state(drafter, prompt, vocab=512):
    capacity = draft_capacity(len(prompt), 32, drafter.max_nodes)
    return DraftState(drafter.open(capacity), SamplingParams(), torch.Generator(), list(prompt), capacity,
                      drafter.max_nodes, vocab)


def test_outcomes_that_do_not_fit_the_last_proposal_are_refused(tiny):
    state = _state(ModelTreeDrafter(tiny["llama-draft"], 3, 2, 3), [1, 2, 3])
    with pytest.raises(BadRequest, match=r"^an outcome must commit at least one token"):
        state.advance([], [])
    with pytest.raises(BadRequest, match=r"^an accepted path was sent but no proposal is outstanding$"):
        state.advance([1], [4, 5])
    with pytest.raises(BadRequest, match=r"^token ids must be in \[0, 512\), got 4\.\.900$"):
        state.advance([], [4, 900])
    state.advance([], [4])
    tree = draft_many([state])[0].tree
    child = tree.children(0)[0]
    grandchild = tree.children(child)[0]
    sibling = tree.children(0)[1]
    token = lambda node: int(tree.tokens[node])  # noqa: E731
    with pytest.raises(BadRequest, match=r"^an outcome of 1 accepted nodes commits at least 2 tokens, got 1$"):
        state.advance([child], [token(child)])
    with pytest.raises(BadRequest, match=r"is not a root-to-leaf path of the last proposal$"):
        state.advance([grandchild], [token(grandchild), 7])
    with pytest.raises(BadRequest, match=r"is not a root-to-leaf path of the last proposal$"):
        state.advance([sibling, grandchild], [token(sibling), token(grandchild), 7])
    with pytest.raises(BadRequest, match=rf"^token {(token(child) + 1) % 512} at node {child} differs from the proposed {token(child)}$"):
        state.advance([child], [(token(child) + 1) % 512, 7])
    # Nothing was applied by the refusals: the right outcome still goes through.
    assert state.seq == [1, 2, 3, 4]
    state.advance([child, grandchild], [token(child), token(grandchild), 7])
    assert state.seq == [1, 2, 3, 4, token(child), token(grandchild), 7]
    assert (state.rounds, state.drafted, state.accepted, state.last_tree) == (1, 3, 2, None)
    assert list(state.outcomes) == [(3, 2)]  # (levels proposed, accepted): nothing for the refusals
    state.close()


def test_an_outcome_may_commit_text_after_the_bonus(tiny):
    """Several drafters: this draft's chain was accepted in part, then other drafters' fused
    tokens (or rounds this draft sat out) committed more text; it catches up from all of it."""
    drafter = ModelChainDrafter(tiny["llama-draft"], 3)
    state = _state(drafter, [1, 2, 3])
    state.advance([], [4])
    tree = draft_many([state])[0].tree
    first = int(tree.tokens[1])
    state.advance([1], [first, 9, 10, 11])
    assert state.seq == [1, 2, 3, 4, first, 9, 10, 11] and state.accepted == 1
    assert list(state.outcomes) == [(3, 1)]
    again = draft_many([state])[0]
    reference = _state(drafter, [1, 2, 3, 4, first, 9, 10])
    reference.advance([], [11])
    assert again.tree.tokens.tolist() == draft_many([reference])[0].tree.tokens.tolist()
    state.close()
    reference.close()


def test_a_session_cannot_grow_past_what_it_reserved(tiny):
    state = _state(ModelChainDrafter(tiny["llama-draft"], 3), [1, 2, 3])
    with pytest.raises(BadRequest, match=r"^the session grew past the \d+ positions it reserved$"):
        state.advance([], list(range(40)))
    state.close()


def test_draft_many_hands_an_exception_to_its_own_session_only():
    from specctl.spec.drafters import NgramDrafter

    good, broken = _state(NgramDrafter(3), [1, 2, 3, 1, 2]), _state(NgramDrafter(3), [5, 6])
    broken.session.propose = lambda *args: (_ for _ in ()).throw(RuntimeError("broken"))
    for state in (good, broken):
        state.advance([], [3])
    results = draft_many([good, broken])
    assert isinstance(results[0], Proposal) and results[0].tree.tokens.tolist() == [3, 1, 2, 3]
    assert good.last_tree is results[0].tree
    assert isinstance(results[1], RuntimeError) and str(results[1]) == "broken" and broken.last_tree is None
