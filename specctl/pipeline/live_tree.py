"""SpecPipe's dynamic speculative tree (§3.2): levels are appended one per pipeline step
and the tree is re-rooted to a subtree when a token is verified. Pure bookkeeping, no
tensors of hidden states: which nodes exist, which of them a device has in its KV cache
(in cache order, after the committed prefix), the attention mask of a new level over
them, and which cache positions survive a re-rooting (the ancestor mask of Figure 8)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class Node:
    token: int
    parent: int | None  # node id; None for a tree's root
    pos: int  # absolute position in the sequence
    score: float = 1.0  # the draft's cumulative probability of the path to this node


@dataclass(slots=True)
class SpecTree:
    """The nodes of the live tree(s) of one session, by id (ids never repeat)."""
    nodes: dict[int, Node] = field(default_factory=dict)
    _next: int = 0

    def add(self, token: int, parent: int | None, pos: int, score: float = 1.0) -> int:
        node_id = self._next
        self._next += 1
        self.nodes[node_id] = Node(token, parent, pos, score)
        return node_id

    def in_subtree(self, node_id: int, root: int) -> bool:
        while node_id is not None:
            if node_id == root:
                return True
            node_id = self.nodes[node_id].parent
        return False

    def reroot(self, root: int) -> None:
        """Keep only ``root``'s subtree; ``root`` becomes the tree's root (call after every
        cache mirror has been re-rooted: they need the old links)."""
        self.nodes = {i: n for i, n in self.nodes.items() if self.in_subtree(i, root)}
        self.nodes[root].parent = None

    def path(self, node_id: int) -> list[int]:
        """The tokens from the root's child down to ``node_id`` (none for the root itself)."""
        tokens = []
        while self.nodes[node_id].parent is not None:
            tokens.append(self.nodes[node_id].token)
            node_id = self.nodes[node_id].parent
        return tokens[::-1]

    def children(self, node_id: int) -> list[int]:
        return [i for i, n in self.nodes.items() if n.parent == node_id]


@dataclass(slots=True)
class CacheMirror:
    """What one device's KV cache holds for a session: ``prefix`` committed positions, then
    the tree nodes of ``order``. Every device applies the same levels and prunings in the
    same order, so one mirror describes every pipeline stage."""
    prefix: int
    order: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.prefix + len(self.order)

    def level_mask(self, tree: SpecTree, level: list[int]) -> torch.Tensor:
        """[n, len(order) + n]: each new node sees its cached ancestors, its ancestors among
        the new nodes (a refill sends several levels at once, parents first) and itself (the
        committed prefix before these columns is visible to all)."""
        index = {node_id: i for i, node_id in enumerate(self.order + level)}
        mask = torch.zeros(len(level), len(self.order) + len(level), dtype=torch.bool)
        for row, node_id in enumerate(level):
            mask[row, len(self.order) + row] = True
            parent = tree.nodes[node_id].parent
            while parent is not None:
                if parent in index:
                    mask[row, index[parent]] = True
                parent = tree.nodes[parent].parent
        return mask

    def append(self, level: list[int]) -> None:
        self.order.extend(level)

    def reroot(self, tree: SpecTree, committed: int, new_root: int | None) -> list[int]:
        """The verified ``committed`` node joins the prefix and only ``new_root``'s subtree
        stays cached (None: a miss, nothing of the tree stays). Returns the cache positions
        to keep, ascending; ``committed`` must be the oldest cached tree node."""
        if not self.order or self.order[0] != committed:
            raise ValueError(f"node {committed} is not the oldest cached tree node")
        keep = list(range(self.prefix + 1))
        survivors = []
        for i, node_id in enumerate(self.order[1:], start=1):
            if new_root is not None and tree.in_subtree(node_id, new_root):
                keep.append(self.prefix + i)
                survivors.append(node_id)
        self.prefix += 1
        self.order = survivors
        return keep
