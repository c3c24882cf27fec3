import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


@given(st.lists(st.integers(0, 150_000), max_size=24), st.data())
@settings(max_examples=60, deadline=None)
def test_a_chain_built_at_once_is_the_chain_appended_level_by_level(tokens, data):
    probs = data.draw(st.one_of(st.none(), st.lists(st.floats(0.0, 1.0), min_size=len(tokens), max_size=len(tokens))))
    stepwise = TokenTree.root(5)
    for i, token in enumerate(tokens):
        p = 1.0 if probs is None else probs[i]
        stepwise = stepwise.append_layer(torch.tensor([len(stepwise) - 1]), torch.tensor([token]), torch.tensor([p]))
    chain = TokenTree.chain(5, tokens, probs)
    for field in ("tokens", "parents", "probs", "depth", "mask", "score"):  # bit for bit, dtypes included
        a, b = getattr(stepwise, field), getattr(chain, field)
        assert a.dtype == b.dtype and torch.equal(a, b), field


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


@given(st.lists(st.integers(-1, 8), min_size=1, max_size=12), st.integers(0, 11))
@settings(max_examples=200, deadline=None)
def test_height_is_the_deepest_node_s_depth_however_the_tree_was_made(parent_picks, prune_at):
    """``height`` (max_depth) is a Python int every constructor sets, so the event loop reads
    a round's depth without a torch op; it must equal the depth tensor's maximum."""
    from specctl.engine.tree import tree_depths

    tree = TokenTree.root(0)
    for pick in parent_picks:  # each new node under a node of the deepest level or the one above it
        candidates = [i for i in range(len(tree)) if int(tree.depth[i]) >= tree.height - 1]
        parent = candidates[pick % len(candidates)] if pick >= 0 else candidates[-1]
        if int(tree.depth[parent]) < tree.height:  # BFS: a new level only under the deepest one
            parent = candidates[-1]
        tree = tree.append_layer(torch.tensor([parent]), torch.tensor([len(tree)]), torch.tensor([0.5]))
        assert tree.height == int(tree.depth.max())
    rebuilt = TokenTree.from_parents(tree.tokens.tolist(), tree.parents.tolist())
    assert rebuilt.height == tree.height == max(tree_depths(tree.tokens.tolist(), tree.parents.tolist(),
                                                            [1.0] * len(tree)))
    sub, _ = tree.prune_to_subtree(prune_at % len(tree))
    assert sub.height == int(sub.depth.max())
    assert TokenTree.chain(3, [4] * len(parent_picks)).height == len(parent_picks) == TokenTree.chain(
        3, [4] * len(parent_picks)).depth.max()
