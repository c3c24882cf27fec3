"""Fusion of several drafters' proposals — chains or trees — into one proposal tree (CoSine /
SpecInfer's merged tree), as pure functions: shared prefixes become one path, and at every
node the children are ordered by confidence (the acceptance rules try them in that order).
The tree holds at most ``budget`` nodes besides the root: drafts are added best drafter
first, each in its own BFS order, and cut where the budget runs out (a node whose parent
was cut is cut too).

The tree is verified like any tree: greedy by following the target's argmax, sampled by
the rule for deterministic candidates (recursive rejection with renormalisation), which is
lossless for any candidates chosen without the target's randomness. No draft q is passed.
Fusion runs in plain Python (a target instance fuses on its event loop): the tree comes back as
a PlainTree, whose tensors the compute thread builds."""

from __future__ import annotations

from dataclasses import dataclass

from specctl.engine.tree import PlainTree, TokenTree


@dataclass(frozen=True, slots=True)
class Draft:
    """One drafter's proposal after the root: node i + 1 (a TokenTree's numbering, the root
    is 0) has ``tokens[i]``, parent ``parents[i]`` (0 = the root; parents come first) and
    the drafter's confidence ``confidences[i]``."""
    tokens: list[int]
    parents: list[int]
    confidences: list[float]

    @classmethod
    def chain(cls, tokens: list[int], confidences: list[float]) -> "Draft":
        return cls(list(tokens), list(range(len(tokens))), list(confidences))

    @classmethod
    def of_tree(cls, tree: TokenTree | PlainTree, confidences: list[float] | None = None) -> "Draft":
        plain = tree.plain()
        return cls(plain.tokens[1:], plain.parents[1:], plain.probs[1:] if confidences is None else confidences)

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.parents) == len(self.confidences):
            raise ValueError("a draft needs one parent and one confidence per token")
        if any(not 0 <= parent <= i for i, parent in enumerate(self.parents)):
            raise ValueError("a draft's parents must come before their children")


def fuse(root: int, drafts: list[Draft], budget: int) -> tuple[PlainTree, list[list[int | None]]]:
    """Merge drafts into one BFS-ordered tree. Returns the tree and, per draft, the tree node
    each of its nodes landed on (None where the budget cut it)."""
    if budget < 0:
        raise ValueError(f"the fusion budget must be >= 0, got {budget}")
    # A trie: node -> {token: child}; confidence of a node = the highest any draft gave it.
    children: list[dict[int, int]] = [{}]
    tokens, parents, confidence = [root], [-1], [1.0]
    placed: list[list[int | None]] = []
    for draft in drafts:
        where: list[int | None] = []
        for token, parent, c in zip(draft.tokens, draft.parents, draft.confidences):
            above = 0 if parent == 0 else where[parent - 1]
            child = None if above is None else children[above].get(token)
            if above is not None and child is None and len(tokens) - 1 < budget:
                child = len(tokens)
                children[above][token] = child
                children.append({})
                tokens.append(token)
                parents.append(above)
                confidence.append(c)
            elif child is not None:
                confidence[child] = max(confidence[child], c)
            where.append(child)
        placed.append(where)
    # BFS order, siblings by descending confidence (then by token, for determinism).
    order, frontier = [0], [0]
    while frontier:
        level = []
        for node in frontier:
            level.extend(sorted(children[node].values(), key=lambda n: (-confidence[n], tokens[n])))
        order.extend(level)
        frontier = level
    index = {old: new for new, old in enumerate(order)}
    tree = PlainTree.checked([tokens[n] for n in order], [-1] + [index[parents[n]] for n in order[1:]],
                             [confidence[n] for n in order])
    return tree, [[None if n is None else index[n] for n in where] for where in placed]


def fuse_chains(root: int, chains: list[tuple[list[int], list[float]]], budget: int) -> tuple[PlainTree, list[list[int]]]:
    """``fuse`` for chains: per chain, the tree nodes of its kept tokens (a prefix of it)."""
    tree, placed = fuse(root, [Draft.chain(tokens, confidences) for tokens, confidences in chains], budget)
    return tree, [where[: where.index(None)] if None in where else where for where in placed]


def own_path(path: list[int], where: list[int | None]) -> list[int]:
    """The verified ``path`` (fused tree nodes, root excluded) as far as it runs through one
    draft: that draft's node numbers (1-based) along it."""
    own = {node: i + 1 for i, node in reversed(list(enumerate(where))) if node is not None}
    taken = []
    for node in path:
        if node not in own:
            break
        taken.append(own[node])
    return taken


def routing_outcome(draft: Draft, where: list[int | None], taken: list[int]) -> tuple[list[float], int]:
    """What a round says of a drafter (for its routing score): the confidences of its nodes on
    the verified path (accepted), then of its likeliest kept line below them (rejected).
    For a chain that is every kept token, the first ``len(taken)`` accepted."""
    kept = [i + 1 for i, node in enumerate(where) if node is not None]
    confidences = [draft.confidences[i - 1] for i in taken]
    node = taken[-1] if taken else 0
    while below := [i for i in kept if draft.parents[i - 1] == node]:
        node = max(below, key=lambda i: draft.confidences[i - 1])
        confidences.append(draft.confidences[node - 1])
    return confidences, len(taken)


def accepted_prefix(path: list[int], chain_nodes: list[int]) -> int:
    """How many of a chain's tokens the accepted ``path`` (root excluded) took."""
    count = 0
    for accepted, node in zip(path, chain_nodes):
        if accepted != node:
            break
        count += 1
    return count
