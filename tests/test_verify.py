"""The acceptance rules as pure functions: exact paths for greedy, exact distributions
(chi-square at a fixed seed) for sampling."""

import pytest
import torch
from scipy.stats import chisquare

from specctl.engine.tree import TokenTree
from specctl.spec.verify import accept_at_node, accept_chain_sampling, accept_greedy, accept_tree_sampling


def _logits_with_argmax(argmax: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(argmax), vocab)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


def test_greedy_follows_the_matching_branch():
    # root -> 3, 4 ; 3 -> 5 ; 4 -> 6
    tree = TokenTree.root(1).append_layer(torch.tensor([0, 0]), torch.tensor([3, 4]), torch.ones(2))
    tree = tree.append_layer(torch.tensor([1, 2]), torch.tensor([5, 6]), torch.ones(2))
    # target argmax per node: root->4, node1->5, node2->6, node3->0, node4->7
    path, bonus = accept_greedy(tree, _logits_with_argmax([4, 5, 6, 0, 7]))
    assert path == [2, 4] and bonus == 7


def test_greedy_rejects_at_the_root():
    tree = TokenTree.chain(1, [3, 4])
    assert accept_greedy(tree, _logits_with_argmax([2, 4, 5])) == ([], 2)


def test_greedy_accepts_a_whole_chain_and_adds_the_bonus():
    tree = TokenTree.chain(1, [3, 4])
    assert accept_greedy(tree, _logits_with_argmax([3, 4, 6])) == ([1, 2], 6)


def _first_token(path, bonus, tree) -> int:
    return int(tree.tokens[path[0]]) if path else bonus


P = torch.tensor([0.30, 0.25, 0.2, 0.1, 0.1, 0.05])
Q = torch.tensor([0.05, 0.1, 0.4, 0.3, 0.1, 0.05])
N = 6000


def _assert_distribution(samples: list[int], p: torch.Tensor):
    counts = torch.bincount(torch.tensor(samples), minlength=p.numel()).double()
    expected = p.double() / p.double().sum() * len(samples)
    result = chisquare(counts.numpy(), expected.numpy())
    assert result.pvalue > 0.01, (counts / len(samples), p)


def test_chain_sampling_preserves_the_target_distribution():
    gen = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(N):
        x = int(torch.multinomial(Q, 1, generator=gen))
        tree = TokenTree.chain(0, [x], [float(Q[x])])
        path, bonus = accept_chain_sampling(tree, Q.unsqueeze(0), torch.stack([P, P]), gen)
        samples.append(_first_token(path, bonus, tree))
    _assert_distribution(samples, P)


@pytest.mark.parametrize("children", [[2, 3, 0], [5], [0, 1, 2, 3, 4, 5]])
def test_tree_sampling_preserves_the_target_distribution(children):
    gen = torch.Generator().manual_seed(1)
    tree = TokenTree.root(0).append_layer(torch.zeros(len(children), dtype=torch.long), torch.tensor(children), torch.ones(len(children)))
    target = torch.stack([P] * len(tree))
    samples = [_first_token(*accept_tree_sampling(tree, target, gen), tree) for _ in range(N)]
    _assert_distribution(samples, P)


def test_a_node_tries_a_repeated_candidate_once_and_draws_the_rest_from_what_is_left():
    gen = torch.Generator().manual_seed(3)
    p = torch.tensor([0.5, 0.0, 0.5])
    outcomes = {accept_at_node([0, 0], p, gen) for _ in range(200)}
    assert outcomes == {(0, 0), (None, 2)}  # the second try of token 0 has p(0) = 0 after its rejection
    assert {accept_at_node([0, 1], torch.tensor([0.0, 0.0, 1.0]), gen) for _ in range(20)} == {(None, 2)}


def test_a_chain_rejection_with_no_residual_draws_from_p():
    # a proposed token q gave no mass (a remote draft's q is taken as sent): rejected, and with
    # p == q the residual max(0, p - q) is empty, so the bonus comes from p itself
    gen = torch.Generator().manual_seed(4)
    p = torch.tensor([0.5, 0.5, 0.0])
    tree = TokenTree.chain(0, [2])
    outcomes = [accept_chain_sampling(tree, p[None], torch.stack([p, p]), gen) for _ in range(40)]
    assert {(tuple(path), bonus) for path, bonus in outcomes} == {((), 0), ((), 1)}


def test_a_node_with_no_mass_says_so():
    with pytest.raises(ValueError, match="cannot sample from a distribution with no mass"):
        accept_at_node([0], torch.zeros(3), torch.Generator().manual_seed(0))


def test_tree_sampling_never_accepts_a_zero_probability_child():
    gen = torch.Generator().manual_seed(2)
    p = torch.tensor([0.0, 1.0, 0.0])
    tree = TokenTree.chain(0, [0])
    for _ in range(50):
        assert accept_tree_sampling(tree, torch.stack([p, p]), gen) == ([], 1)
