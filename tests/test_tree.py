import torch

from specctl.engine.tree import TokenTree


def _example() -> TokenTree:
    # root(10) -> a(11), b(12); a -> c(13)
    tree = TokenTree.root(10)
    tree = tree.append_layer(torch.tensor([0, 0]), torch.tensor([11, 12]), torch.tensor([0.6, 0.3]))
    return tree.append_layer(torch.tensor([1]), torch.tensor([13]), torch.tensor([0.5]))


def test_layer_appending_builds_the_ancestor_mask():
    tree = _example()
    assert tree.tokens.tolist() == [10, 11, 12, 13]
    assert tree.parents.tolist() == [-1, 0, 0, 1]
    assert tree.depth.tolist() == [0, 1, 1, 2]
    assert tree.mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert tree.children(0) == [1, 2] and tree.path_to(3) == [0, 1, 3]
    torch.testing.assert_close(tree.score.exp(), torch.tensor([1.0, 0.6, 0.3, 0.3]))


def test_prune_to_subtree_keeps_the_node_and_its_descendants():
    sub, keep = _example().prune_to_subtree(1)
    assert keep.tolist() == [1, 3]
    assert sub.tokens.tolist() == [11, 13] and sub.parents.tolist() == [-1, 0]
    assert sub.depth.tolist() == [0, 1] and sub.mask.int().tolist() == [[1, 0], [1, 1]]


def test_chain_is_a_path():
    chain = TokenTree.chain(5, [6, 7, 8])
    assert chain.parents.tolist() == [-1, 0, 1, 2]
    assert torch.equal(chain.mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_fixed_width_growth_keeps_best_cumulative_probability():
    tree = TokenTree.root(0)
    level1 = torch.tensor([[0.0, 0.5, 0.3, 0.2]])
    tree = tree.grow(torch.tensor([0]), level1, topk=2, width=2)
    assert tree.tokens.tolist() == [0, 1, 2]
    # Node 1 (p=.5) proposes {3: .9, 0: .1}; node 2 (p=.3) proposes {1: .8, 2: .2}.
    level2 = torch.tensor([[0.1, 0.0, 0.0, 0.9], [0.0, 0.8, 0.2, 0.0]])
    tree = tree.grow(torch.tensor([1, 2]), level2, topk=2, width=2)
    # Cumulative: .45 (1->3), .24 (2->1), .06, .05: the best two, grouped by parent.
    assert tree.tokens.tolist() == [0, 1, 2, 3, 1]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2]
    torch.testing.assert_close(tree.score[3:].exp(), torch.tensor([0.45, 0.24]))


def test_growth_skips_zero_probability_candidates():
    tree = TokenTree.root(0).grow(torch.tensor([0]), torch.tensor([[0.0, 1.0, 0.0]]), topk=3, width=3)
    assert tree.tokens.tolist() == [0, 1]
