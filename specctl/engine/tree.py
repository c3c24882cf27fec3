"""Token tree in BFS order (SpecPipe §3.2): token ids I, draft probabilities P and the
ancestor mask M, where M[i, j] is True iff j is i or an ancestor of i. Node 0 is the root:
the last verified token, not yet in the target's KV cache.

Two structural operations, both pure (they return a new tree):
- layer appending: a new level under its parents. The new M keeps the old M top-left,
  copies each parent's row bottom-left (a child's ancestors are its parent's plus itself)
  and puts the identity bottom-right.
- to-subtree pruning: re-root at node i, keeping the nodes whose row has M[:, i] set
  (i and its descendants). The kept indices also prune the KV cache.

A PlainTree is the same tree as Python lists: what the event loop's thread handles (a
proposal off the wire, a fusion of drafts), checked there without a torch op; the compute
thread, which owns every torch call, builds its TokenTree."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class TokenTree:
    tokens: torch.Tensor  # [n] long
    parents: torch.Tensor  # [n] long, -1 for the root
    probs: torch.Tensor  # [n] float: draft probability of each node given its parent
    depth: torch.Tensor  # [n] long, 0 for the root
    mask: torch.Tensor  # [n, n] bool ancestor mask
    score: torch.Tensor  # [n] float: cumulative log draft probability from the root
    height: int  # the deepest node's depth, as a Python int: readable on the event loop without a torch op

    @classmethod
    def root(cls, token: int) -> "TokenTree":
        return cls(
            tokens=torch.tensor([token]),
            parents=torch.tensor([-1]),
            probs=torch.ones(1),
            depth=torch.zeros(1, dtype=torch.long),
            mask=torch.ones(1, 1, dtype=torch.bool),
            score=torch.zeros(1),
            height=0,
        )

    @classmethod
    def chain(cls, root: int, tokens: list[int], probs: list[float] | None = None) -> "TokenTree":
        """Root + one node a level: built at once (what appending a layer per token gives, at a
        fraction of the host time a draft round spends on it)."""
        n = len(tokens) + 1
        p = torch.tensor([1.0, *([1.0] * len(tokens) if probs is None else probs)], dtype=torch.float32)
        log_p = p.clamp_min(1e-30).log()
        log_p[0] = 0.0
        return cls(
            tokens=torch.tensor([root, *tokens], dtype=torch.long),
            parents=torch.arange(-1, n - 1),
            probs=p,
            depth=torch.arange(n),
            mask=torch.ones(n, n, dtype=torch.bool).tril(),
            score=torch.from_numpy(np.add.accumulate(log_p.numpy())),  # sequential, as appended level by level
            height=n - 1,
        )

    @classmethod
    def from_parents(cls, tokens: list[int], parents: list[int], probs: list[float] | None = None) -> "TokenTree":
        """Rebuild a tree sent over the wire, checking it is a BFS-ordered tree (the
        verifier needs no draft probabilities: they default to 1)."""
        n = len(tokens)
        probs = [1.0] * n if probs is None else probs
        depth = tree_depths(tokens, parents, probs)
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[0, 0] = True
        for i in range(1, n):
            mask[i] = mask[parents[i]]
            mask[i, i] = True
        p = torch.tensor(probs, dtype=torch.float32)
        par = torch.tensor(parents, dtype=torch.long)
        log_p = p.clamp_min(1e-30).log()
        log_p[0] = 0.0
        return cls(
            tokens=torch.tensor(tokens, dtype=torch.long),
            parents=par,
            probs=p,
            depth=torch.tensor(depth, dtype=torch.long),
            mask=mask,
            score=(mask.float() * log_p.unsqueeze(0)).sum(-1),
            height=max(depth),
        )

    def __len__(self) -> int:
        return self.tokens.numel()

    def plain(self) -> "PlainTree":
        return PlainTree(self.tokens.tolist(), self.parents.tolist(), self.probs.tolist(), self.height)

    @property
    def max_depth(self) -> int:
        return self.height

    def level(self, depth: int) -> torch.Tensor:
        return (self.depth == depth).nonzero().flatten()

    def children(self, node: int) -> list[int]:
        return (self.parents == node).nonzero().flatten().tolist()

    def path_to(self, node: int) -> list[int]:
        """Root-to-node indices, root included."""
        return self.mask[node].nonzero().flatten().tolist()

    def append_layer(self, parents: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor) -> "TokenTree":
        n, m = len(self), parents.numel()
        mask = torch.zeros(n + m, n + m, dtype=torch.bool)
        mask[:n, :n] = self.mask
        mask[n:, :n] = self.mask[parents]
        mask[n:, n:] = torch.eye(m, dtype=torch.bool)
        probs = probs.float()
        return TokenTree(
            tokens=torch.cat([self.tokens, tokens.long()]),
            parents=torch.cat([self.parents, parents.long()]),
            probs=torch.cat([self.probs, probs]),
            depth=torch.cat([self.depth, self.depth[parents] + 1]),
            mask=mask,
            score=torch.cat([self.score, self.score[parents] + probs.clamp_min(1e-30).log()]),
            height=max(self.height, int(self.depth[parents].max()) + 1) if m else self.height,
        )

    def first_levels(self, depth: int) -> "TokenTree":
        """The nodes at most ``depth`` deep: a prefix, since nodes are in BFS order."""
        if depth >= self.height:
            return self
        n = int((self.depth <= depth).sum())
        return TokenTree(self.tokens[:n], self.parents[:n], self.probs[:n], self.depth[:n], self.mask[:n, :n],
                         self.score[:n], depth)

    def prune_to_subtree(self, node: int) -> tuple["TokenTree", torch.Tensor]:
        """Re-root at ``node``; returns the subtree and the kept (old) indices in BFS order."""
        keep = self.mask[:, node].nonzero().flatten()
        remap = torch.full((len(self),), -1, dtype=torch.long)
        remap[keep] = torch.arange(keep.numel())
        parents = remap[self.parents[keep].clamp_min(0)]
        parents[0] = -1
        tree = TokenTree(
            tokens=self.tokens[keep],
            parents=parents,
            probs=torch.cat([torch.ones(1), self.probs[keep][1:]]),
            depth=self.depth[keep] - self.depth[node],
            mask=self.mask[keep][:, keep],
            score=self.score[keep] - self.score[node],
            height=int(self.depth[keep].max() - self.depth[node]),
        )
        return tree, keep

    def grow(self, frontier: torch.Tensor, frontier_probs: torch.Tensor, topk: int, width: int) -> "TokenTree":
        """Fixed-width growth (SpecPipe §3.3.3): each frontier node proposes its top-k draft
        tokens; the best ``width`` by cumulative probability form the new level.

        frontier: [f] node indices; frontier_probs: [f, V] draft distributions at those nodes.
        Children are ordered by parent, then by draft probability (tree sampling tries them
        in this order)."""
        k = min(topk, frontier_probs.shape[-1])
        # The tree lives on the CPU (it is bookkeeping); only the top-k leave the model's device.
        top_p, top_tok = (t.cpu() for t in frontier_probs.topk(k, dim=-1))  # [f, k]
        frontier = frontier.cpu()
        cand_parent = frontier.unsqueeze(1).expand(-1, k).reshape(-1)
        cand_p, cand_tok = top_p.reshape(-1), top_tok.reshape(-1)
        cand_score = self.score[cand_parent] + cand_p.clamp_min(1e-30).log()
        valid = cand_p > 0
        best = cand_score.masked_fill(~valid, float("-inf")).topk(min(width, int(valid.sum()))).indices
        # BFS order within the level: by parent, then by descending probability.
        order = sorted(best.tolist(), key=lambda c: (int(cand_parent[c]), -float(cand_p[c])))
        order = torch.tensor(order, dtype=torch.long)
        if order.numel() == 0:
            return self
        return self.append_layer(cand_parent[order], cand_tok[order], cand_p[order])


def tree_depths(tokens: list[int], parents: list[int], probs: list[float]) -> list[int]:
    """Each node's depth in a tree sent as (tokens, parents, probs), in plain Python (the event
    loop checks a proposal with it before the compute thread builds its tensors); ValueError
    unless it is a BFS-ordered tree rooted at node 0."""
    n = len(tokens)
    if n == 0 or len(parents) != n or len(probs) != n:
        raise ValueError(f"tokens, parents and probs must have the same non-zero length ({n}, {len(parents)}, {len(probs)})")
    if parents[0] != -1:
        raise ValueError("node 0 must be the root (parent -1)")
    depth = [0] * n
    for i in range(1, n):
        parent = parents[i]
        if not 0 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}: parents must precede their children")
        depth[i] = depth[parent] + 1
        if depth[i] < depth[i - 1]:
            raise ValueError("nodes are not in BFS order")
    return depth


@dataclass(frozen=True, slots=True)
class PlainTree:
    """A TokenTree's tokens, parents and draft probabilities (node 0 the root, BFS order) as
    Python lists, with its height."""
    tokens: list[int]
    parents: list[int]
    probs: list[float]
    height: int

    @classmethod
    def checked(cls, tokens: list[int], parents: list[int], probs: list[float] | None = None) -> "PlainTree":
        """The tree, once found to be a BFS-ordered tree rooted at node 0 (ValueError if not)."""
        probs = [1.0] * len(tokens) if probs is None else list(probs)
        return cls(list(tokens), list(parents), probs, max(tree_depths(tokens, parents, probs)))

    @classmethod
    def root(cls, token: int) -> "PlainTree":
        return cls([token], [-1], [1.0], 0)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return self.height

    def plain(self) -> "PlainTree":
        return self

    def built(self) -> TokenTree:
        """Its tensors: on the compute thread."""
        return TokenTree.from_parents(self.tokens, self.parents, self.probs)
