"""Lossless acceptance as pure tensor functions.

Every function takes the proposal tree, the target's logits or probabilities for each tree
node (row j = the target's next-token distribution after node j) and returns
``(path, bonus)``: the accepted node indices (root excluded, root-to-leaf order) and the
bonus token the target contributes after the last accepted node.

Greedy (temperature 0): follow the children whose token equals the target's argmax;
bonus = argmax after the last match. The output equals greedy decoding of the target.

Chain of sampled drafts x_i ~ q_i (Leviathan et al.): accept x_i with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection the bonus ~ norm(max(0, p_i - q_i));
if all d are accepted the bonus ~ p_{d+1}.

Tree of deterministic candidates (top-k children, n-gram tokens): at a node, try its
children in order; accept child x with probability p(x) of the current, renormalised p;
on rejection set p(x) = 0 and renormalise; if every child is rejected, the bonus ~ what
is left of p. Each try is rejection sampling with a one-hot proposal, so the emitted
token is distributed exactly as p."""

from __future__ import annotations

import torch

from specctl.engine.tree import TokenTree
from specctl.spec.params import SamplingParams
from specctl.spec.sampling import probs_from_logits, sample, sample_tensor, uniform


def accept_proposal(logits: torch.Tensor, proposal, params: SamplingParams, generator) -> tuple[list[int], int]:
    """The acceptance rule that keeps this proposal (a spec.drafters.Proposal) lossless:
    greedy; a chain sampled from the draft's q (its rows, or what makes them); deterministic
    candidates."""
    if params.greedy:
        return accept_greedy(proposal.tree, logits)
    p = probs_from_logits(logits, params)
    if (q := proposal.draft_probs) is not None:
        return accept_chain_sampling(proposal.tree, q() if callable(q) else q, p, generator)
    return accept_tree_sampling(proposal.tree, p, generator)


def _children_table(tree: TokenTree) -> list[list[int]]:
    table: list[list[int]] = [[] for _ in range(len(tree))]
    for child, parent in enumerate(tree.parents.tolist()):
        if parent >= 0:
            table[parent].append(child)
    return table


def accept_greedy(tree: TokenTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    argmax = target_logits.argmax(-1).tolist()
    tokens = tree.tokens.tolist()
    children = _children_table(tree)
    node, path = 0, []
    while True:
        match = next((c for c in children[node] if tokens[c] == argmax[node]), None)
        if match is None:
            return path, argmax[node]
        path.append(match)
        node = match


def accept_at_node(candidates: list[int], target_probs: torch.Tensor,
                   generator: torch.Generator | None) -> tuple[int | None, int]:
    """One node of tree sampling: try the candidate tokens in order, accepting x with
    probability p(x) of the current, renormalised p, else setting p(x) = 0. Returns (index
    of the accepted candidate, its token), or (None, a token drawn from what is left of p):
    either way the token is distributed exactly as p."""
    # one copy off the device: the row's total and the candidates' p (not the whole row, and
    # not a read per candidate: each a sync on a GPU); what is left of p is the total less
    # the rejected candidates' mass
    ids = torch.tensor(candidates, dtype=torch.long, device=target_probs.device)
    total, *p_candidates = torch.cat([target_probs.sum().reshape(1), target_probs[ids]]).tolist()
    rejected: set[int] = set()
    for index, x in enumerate(candidates):
        if total <= 0:
            break
        p_x = 0.0 if x in rejected else p_candidates[index]
        if uniform(generator) * total < p_x:
            return index, x
        if x not in rejected:
            rejected.add(x)
            total -= p_x
    left = target_probs.clone()
    left[ids] = 0.0
    token = int(sample_tensor(left, generator))
    # numerically exhausted (every token with mass rejected): fall back to the untouched p
    return None, token if token >= 0 else sample(target_probs, generator)


def accept_tree_sampling(
    tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[list[int], int]:
    tokens = tree.tokens.tolist()
    children = _children_table(tree)
    node, path = 0, []
    while True:
        index, token = accept_at_node([tokens[c] for c in children[node]], target_probs[node], generator)
        if index is None:
            return path, token
        node = children[node][index]
        path.append(node)


def accept_chain_sampling(
    tree: TokenTree, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """tree: a chain (node i+1 is the child of node i); draft_probs[i] = q at node i (the
    distribution node i+1 was sampled from); target_probs[i] = p at node i."""
    tokens = tree.tokens.tolist()
    draft_probs = draft_probs.to(target_probs.device)  # q may come from a draft on another device
    # every node's p(x) and q(x) in one copy each off the device (a read per node syncs a GPU)
    rows = torch.arange(len(tokens) - 1, device=target_probs.device)
    chosen = torch.tensor(tokens[1:], dtype=torch.long, device=target_probs.device)
    p_chosen, q_chosen = target_probs[rows, chosen].tolist(), draft_probs[rows, chosen].tolist()
    path: list[int] = []
    for i in range(len(tree) - 1):
        p_x, q_x = p_chosen[i], q_chosen[i]
        if q_x > 0 and uniform(generator) * q_x < p_x:
            path.append(i + 1)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
        token = int(sample_tensor(residual, generator))  # one read: -1 when the residual has no mass
        return path, token if token >= 0 else sample(target_probs[i], generator)
    last = len(tree) - 1
    return path, sample(target_probs[last], generator)
