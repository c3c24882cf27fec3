"""Fusion of several drafters' chains into one proposal tree (CoSine / SpecInfer's merged
tree), as a pure function: shared prefixes become one path, and at every node the children
are ordered by confidence (the acceptance rules try them in that order). The tree holds at
most ``budget`` nodes besides the root: chains are added best drafter first and cut where
the budget runs out.

The tree is verified like any tree: greedy by following the target's argmax, sampled by
the rule for deterministic candidates (recursive rejection with renormalisation), which is
lossless for any candidates chosen without the target's randomness. No draft q is passed."""

from __future__ import annotations

from specctl.engine.tree import TokenTree


def fuse_chains(root: int, chains: list[tuple[list[int], list[float]]], budget: int) -> tuple[TokenTree, list[list[int]]]:
    """Merge chains (tokens after ``root``, each token's confidence) into one BFS-ordered tree.
    Returns the tree and, per chain, the tree nodes its kept tokens landed on (a prefix of the
    chain: a chain cut by the budget keeps its first tokens)."""
    if budget < 0:
        raise ValueError(f"the fusion budget must be >= 0, got {budget}")
    # A trie: node -> {token: child}; confidence of a node = the highest any chain gave it.
    children: list[dict[int, int]] = [{}]
    tokens, parents, confidence = [root], [-1], [1.0]
    paths: list[list[int]] = []
    for chain_tokens, chain_confidences in chains:
        node, path = 0, []
        for token, c in zip(chain_tokens, chain_confidences):
            child = children[node].get(token)
            if child is None:
                if len(tokens) - 1 >= budget:
                    break
                child = len(tokens)
                children[node][token] = child
                children.append({})
                tokens.append(token)
                parents.append(node)
                confidence.append(c)
            else:
                confidence[child] = max(confidence[child], c)
            path.append(child)
            node = child
        paths.append(path)
    # BFS order, siblings by descending confidence (then by token, for determinism).
    order, frontier = [0], [0]
    while frontier:
        level = []
        for node in frontier:
            level.extend(sorted(children[node].values(), key=lambda n: (-confidence[n], tokens[n])))
        order.extend(level)
        frontier = level
    index = {old: new for new, old in enumerate(order)}
    tree = TokenTree.from_parents([tokens[n] for n in order], [-1] + [index[parents[n]] for n in order[1:]],
                                  [confidence[n] for n in order])
    return tree, [[index[n] for n in path] for path in paths]


def accepted_prefix(path: list[int], chain_nodes: list[int]) -> int:
    """How many of a chain's tokens the accepted ``path`` (root excluded) took."""
    count = 0
    for accepted, node in zip(path, chain_nodes):
        if accepted != node:
            break
        count += 1
    return count
