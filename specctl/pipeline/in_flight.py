"""SpecPipe's levels in flight through the stages (pipeline.specpipe) and what a verification
prunes of them: a level with no live row left is declared dead whole (the stages that have
not run it pass it on uncomputed), one that keeps live rows has its newly dead rows declared
(the stages skip them)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from specctl.pipeline.live_tree import SpecTree
from specctl.pipeline.pipe_stats import PipeStats


@dataclass(slots=True)
class SentLevel:
    """One forward stage 1 sent down the chain: its tree nodes, in row order."""

    future: object
    level: list[int]
    tree_epoch: int
    tag: int  # this session's id of the forward, for StageDrop
    dead: bool = False  # declared dead to the other stages
    dead_rows: set[int] = field(default_factory=set)  # rows declared dead while others live


def pruned_in_flight(in_flight: Iterable[SentLevel], tree: SpecTree, tree_epoch: int,
                     stats: PipeStats) -> tuple[list[int], list[list[int]]]:
    """What to declare dead now that ``tree`` (of ``tree_epoch``) is what lives: per forward's
    tag, its newly dead rows ([] = the whole forward). Marks the forwards as declared and counts
    them in ``stats``."""
    tags, rows = [], []
    for sent in in_flight:
        if sent.dead:
            continue
        gone = [] if sent.tree_epoch != tree_epoch else [
            i for i, node in enumerate(sent.level) if node not in tree.nodes and i not in sent.dead_rows]
        if sent.tree_epoch != tree_epoch or len(gone) + len(sent.dead_rows) == len(sent.level):
            sent.dead = True
            tags.append(sent.tag)
            rows.append([])
            stats.levels_dropped += 1
        elif gone:
            sent.dead_rows.update(gone)
            tags.append(sent.tag)
            rows.append(gone)
            stats.rows_dropped += len(gone)
    return tags, rows
