"""pipeline.in_flight: what a verification prunes of SpecPipe's levels in flight."""

from specctl.pipeline.in_flight import SentLevel, pruned_in_flight
from specctl.pipeline.live_tree import SpecTree
from specctl.pipeline.pipe_stats import PipeStats


def _tree() -> tuple[SpecTree, list[int]]:
    """root -> a, b; a -> c, d; b -> e: ids 0..5."""
    tree = SpecTree()
    root = tree.add(1, None, 10)
    a, b = tree.add(2, root, 11), tree.add(3, root, 11)
    c, d, e = tree.add(4, a, 12), tree.add(5, a, 12), tree.add(6, b, 12)
    return tree, [root, a, b, c, d, e]


def test_a_reroot_declares_the_pruned_rows_and_the_wholly_pruned_levels():
    tree, (root, a, b, c, d, e) = _tree()
    children, grandchildren = SentLevel(None, [a, b], 0, 1), SentLevel(None, [c, d, e], 0, 2)
    cousins_only = SentLevel(None, [e], 0, 3)
    tree.reroot(a)  # a verified: b's subtree is gone
    stats = PipeStats()
    tags, rows = pruned_in_flight([children, grandchildren, cousins_only], tree, 0, stats)
    assert (tags, rows) == ([1, 2, 3], [[1], [2], []])
    assert (children.dead, children.dead_rows, grandchildren.dead, grandchildren.dead_rows) == (False, {1}, False, {2})
    assert cousins_only.dead and (stats.levels_dropped, stats.rows_dropped) == (1, 2)
    # declared once: asking again declares nothing new
    assert pruned_in_flight([children, grandchildren, cousins_only], tree, 0, stats) == ([], [])
    # c verified next: the level of a and b has no live row left (dead whole, b's row declared
    # before), the grandchildren keep c (d declared now, e before)
    tree.reroot(c)
    assert pruned_in_flight([children, grandchildren], tree, 0, stats) == ([1, 2], [[], [1]])
    assert children.dead and not grandchildren.dead and grandchildren.dead_rows == {1, 2}
    assert (stats.levels_dropped, stats.rows_dropped) == (2, 3)

def test_a_flushed_tree_s_levels_are_dead_whole():
    tree, (root, a, b, c, d, e) = _tree()
    old = [SentLevel(None, [a, b], 0, 1), SentLevel(None, [c], 0, 2)]
    stats = PipeStats()
    assert pruned_in_flight(old, tree, 1, stats) == ([1, 2], [[], []])
    assert all(sent.dead for sent in old) and (stats.levels_dropped, stats.rows_dropped) == (2, 0)
