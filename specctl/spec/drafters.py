"""Drafters propose; they never decide. Each opens a per-session state that sees the
committed sequence (prompt + accepted tokens; its last token is the tree root) and
returns a Proposal. After verification it is told which tree nodes were accepted, so
model drafters keep exactly the KV of the accepted path.

- ModelChainDrafter: a chain of depth d, one draft forward per token; samples its tokens
  from q when the request samples (chain acceptance needs q), argmax when greedy.
- ModelTreeDrafter: depth d, top-k children per frontier node, width w; the whole frontier
  is drafted in one batched forward per level with a tree mask.
- NgramDrafter: prompt lookup in the session's own tokens; costs nothing.
- NoDrafter: proposes nothing, which makes the loop plain autoregressive decoding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specctl.engine.kv_cache import KVPool
from specctl.engine.model import Decoder
from specctl.engine.tree import TokenTree
from specctl.spec.sampling import (
    DRAFT_SUPPORT, SamplingParams, checked_token, keep_top, probs_from_logits, sample_tensor,
)


@dataclass(frozen=True, slots=True)
class Proposal:
    tree: TokenTree
    # q for each chain position when the chain's tokens were sampled from it: [len(tree)-1, V]
    draft_probs: torch.Tensor | None = None
    # The draft's candidates after each node in its KV (every node but the last level: a
    # chain's x_0..x_{d-1}), likeliest first: [fed + 1, RANKED] token ids (pre-speculation
    # guesses the bonus token among them)
    ranked: torch.Tensor | None = None


RANKED = 16  # candidates a model drafter keeps per node it feeds


def ranked_candidates(logits: torch.Tensor) -> torch.Tensor:
    """The draft's RANKED likeliest tokens after each row of ``logits``, likeliest first."""
    return logits.topk(min(RANKED, logits.shape[-1]), dim=-1).indices


class DraftSession:
    def propose(self, seq: list[int], params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        raise NotImplementedError

    def on_verified(self, path: list[int]) -> None:
        """``path``: accepted node indices of the last proposal (root excluded)."""

    def close(self) -> None:
        """Free per-session state (KV cache)."""


class Drafter:
    name = "none"
    max_nodes = 1  # most tree nodes (root included) a proposal can have
    free = False  # True: proposing costs nothing worth counting (no model, no network); routing prefers it

    def open(self, capacity: int, pool: KVPool | None = None) -> DraftSession:
        return DraftSession()


class NoDrafter(Drafter):
    """Autoregressive decoding: every round verifies the root alone."""

    def open(self, capacity: int, pool: KVPool | None = None) -> DraftSession:
        return _RootOnlySession()


class _RootOnlySession(DraftSession):
    def propose(self, seq, params, generator):
        return Proposal(TokenTree.root(seq[-1]))


def _draft_params(params: SamplingParams) -> SamplingParams:
    return params if not params.greedy else SamplingParams(temperature=0.0)


class _ModelDraftSession(DraftSession):
    def __init__(self, decoder: Decoder, capacity: int, pool: KVPool | None) -> None:
        self.decoder = decoder
        self.cache = decoder.new_cache(capacity, pool)

    def close(self) -> None:
        self.cache.release()


class ModelChainDrafter(Drafter):
    name = "chain"

    def __init__(self, decoder: Decoder, depth: int, stop: float = 0.0) -> None:
        self.decoder, self.depth, self.stop = decoder, depth, stop
        self.max_nodes = depth + 1

    def open(self, capacity: int, pool: KVPool | None = None) -> DraftSession:
        return _ChainSession(self.decoder, capacity, pool, self.depth, self.stop)


class _ChainSession(_ModelDraftSession):
    def __init__(self, decoder: Decoder, capacity: int, pool: KVPool | None, depth: int, stop: float) -> None:
        super().__init__(decoder, capacity, pool)
        self.depth, self.stop = depth, stop
        self.committed = 0
        # (position, q) -> the q to sample from instead (Saguaro sampling); None = q itself
        self.reshape: Callable[[int, torch.Tensor], torch.Tensor] | None = None

    def propose(self, seq, params, generator):
        return propose_chains([self], [seq], [params], [generator])[0]

    def holds_text_only(self) -> None:
        """The cache holds a prefix of the text and none of the outstanding proposal's nodes
        (a proposal from elsewhere, e.g. the n-gram backup): the next outcome keeps all of it."""
        self.committed = self.cache.length

    def on_verified(self, path):
        # The cache holds seq + x_1..x_{d-1}; keep seq + the accepted x's it holds.
        self.cache.truncate(min(self.committed + len(path), self.cache.length))


class ModelTreeDrafter(Drafter):
    name = "tree"

    def __init__(self, decoder: Decoder, depth: int, topk: int, width: int, stop: float = 0.0) -> None:
        self.decoder, self.depth, self.topk, self.width, self.stop = decoder, depth, topk, width, stop
        self.max_nodes = 1 + depth * width

    def open(self, capacity: int, pool: KVPool | None = None) -> DraftSession:
        return _TreeSession(self.decoder, capacity, pool, self)


def tree_shape(session: DraftSession) -> ModelTreeDrafter | None:
    """The tree drafter whose session this is (its top-k, width, depth), or None."""
    return session.shape if isinstance(session, _TreeSession) else None


def tree_score_params(params: SamplingParams) -> SamplingParams:
    """What tree drafting ranks candidates by: the draft's softmax (T = 1) for a greedy
    request, the request's own processed distribution when it samples."""
    return SamplingParams(temperature=1.0) if params.greedy else _draft_params(params)


class _TreeSession(_ModelDraftSession):
    def __init__(self, decoder: Decoder, capacity: int, pool: KVPool | None, shape: ModelTreeDrafter) -> None:
        super().__init__(decoder, capacity, pool)
        self.shape = shape
        self.committed = 0
        self.fed = 0  # tree nodes 1..fed are in the cache at positions committed + (node - 1)

    def propose(self, seq, params, generator):
        return propose_trees([self], [seq], [params], [generator])[0]

    def holds_text_only(self) -> None:
        self.committed, self.fed = self.cache.length, 0

    def on_verified(self, path):
        fed = torch.tensor([self.committed + node - 1 for node in path if node <= self.fed], dtype=torch.long)
        self.cache.gather(torch.cat([torch.arange(self.committed), fed]))


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n from max_ngram down to min_ngram) that is followed by ``depth`` tokens, and propose
    them; failing that, the occurrence followed by the most tokens (the latest of those).
    The latest occurrence alone falls short in a loop: in "x x x x" the latest "x x x" is
    followed by one token, while the text repeats for as long as it loops."""

    name = "ngram"
    free = True  # a lookup in the text

    def __init__(self, depth: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.depth, self.max_ngram, self.min_ngram = depth, max_ngram, min_ngram
        self.max_nodes = depth + 1

    def lookup(self, seq: list[int]) -> list[int]:
        n_seq = len(seq)
        for n in range(min(self.max_ngram, n_seq - 1), self.min_ngram - 1, -1):
            pattern, longest = seq[n_seq - n :], []
            for start in range(n_seq - n - 1, -1, -1):
                if seq[start : start + n] == pattern:
                    follow = seq[start + n : start + n + self.depth]
                    if len(follow) == self.depth:
                        return follow
                    if len(follow) > len(longest):
                        longest = follow
            if longest:
                return longest
        return []

    def open(self, capacity: int, pool: KVPool | None = None) -> DraftSession:
        drafter = self

        class _Session(DraftSession):
            def propose(self, seq, params, generator):
                return Proposal(TokenTree.chain(seq[-1], drafter.lookup(seq)))

        return _Session()


def _catch_up_many(sessions: list["_ModelDraftSession"], seqs: list[list[int]]) -> list[torch.Tensor]:
    """Feed each session the committed tokens its cache lacks, all in one forward; the
    logits after each one's last token."""
    inputs, positions, at = [], [], []
    for session, seq in zip(sessions, seqs):
        session.committed, start = len(seq), session.cache.length
        inputs.append(torch.tensor(seq[start:], dtype=torch.long))
        positions.append(torch.arange(start, len(seq)))
        at.append(torch.tensor([len(seq) - start - 1]))
    return sessions[0].decoder.forward_many(inputs, positions, [s.cache for s in sessions], [None] * len(sessions), at)


def propose_chains(sessions: list["_ChainSession"], seqs: list[list[int]], params: list[SamplingParams],
                   generators: list[torch.Generator | None]) -> list[Proposal]:
    """Draft a chain for several sessions at once: every step is one forward over all of
    them (the weights are read once per step instead of once per session). Adaptive depth:
    a session stops drafting once the draft's own probability of its chain so far falls
    below ``stop`` (greedy chains are scored by the draft's softmax at T = 1); the
    proposal's length never affects what is accepted, only what drafting costs."""
    decoder, depth, stop = sessions[0].decoder, sessions[0].depth, sessions[0].stop
    caches = [s.cache for s in sessions]
    logits = _catch_up_many(sessions, seqs)
    # Greedy chains with no adaptive depth decide nothing on the host between steps: each
    # step's token goes to the next forward on the device and the chain is read back once.
    # On a GPU the host then prepares step i + 1 while the device runs step i (issue 11: a
    # read-back per step left the device idle for the host's part of every step).
    read_once = not stop and all(p.greedy for p in params)
    picks: list[list[torch.Tensor]] = [[] for _ in sessions]  # per step: [token, its probability], on the device
    last: list[torch.Tensor] = [torch.empty(0)] * len(sessions)  # each session's last token [1], on the device
    dists: list[list[torch.Tensor | None]] = [[] for _ in sessions]
    ranked: list[list[torch.Tensor]] = [[] for _ in sessions]
    drafted: list[list[tuple[int, float]]] = [[] for _ in sessions]  # (token, probability) read back per step
    reach = [1.0] * len(sessions)
    live = list(range(len(sessions)))
    for i in range(depth):
        for rows, b in zip(logits, live):
            ranked[b].append(ranked_candidates(rows[0]))
            # How likely the draft finds its token (greedy: its softmax at T = 1; sampled: q) is
            # read back with the token. It is the node's probability in the tree: adaptive depth
            # and routing among drafters use it. (gather, not [chosen]: indexing by a 0-d tensor
            # reads it back to the host, a device sync.)
            if params[b].greedy:
                # no q: the proposal carries none (a one-hot q cost two vocabulary-sized kernels a step)
                q, logit_row = None, rows[0].float()
                chosen = logit_row.argmax()
                likely = logit_row.softmax(-1).gather(0, chosen.view(1))[0]
            else:
                q = keep_top(probs_from_logits(rows[0], params[b]), DRAFT_SUPPORT)
                if sessions[b].reshape is not None:
                    q = sessions[b].reshape(i, q)
                chosen = sample_tensor(q, generators[b])
                likely = q.gather(0, chosen.view(1))[0]
            picks[b].append(torch.stack([chosen.double(), likely.double()]))
            last[b] = chosen.view(1)
            dists[b].append(q)
            if not read_once:
                x, p_x = picks[b][-1].tolist()
                drafted[b].append((checked_token(int(x)), p_x))
                reach[b] *= p_x
        live = [b for b in live if reach[b] >= stop]
        if not live:
            break
        if i + 1 < depth:
            one = torch.tensor([0])
            logits = decoder.forward_many([last[b] for b in live], [torch.tensor([len(seqs[b]) + i]) for b in live],
                                          [caches[b] for b in live], [None] * len(live), [one] * len(live))
    if read_once:  # every session drafted all d steps: one read-back of all chains
        read = torch.stack([torch.stack(steps) for steps in picks]).tolist()
        drafted = [[(checked_token(int(x)), p_x) for x, p_x in steps] for steps in read]
    proposals = []
    for b, (seq, p) in enumerate(zip(seqs, params)):
        tokens, probs = [x for x, _ in drafted[b]], [p_x for _, p_x in drafted[b]]
        proposals.append(Proposal(TokenTree.chain(seq[-1], tokens, probs), None if p.greedy else torch.stack(dists[b]),
                                  torch.stack(ranked[b])))
    return proposals


def propose_trees(sessions: list["_TreeSession"], seqs: list[list[int]], params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> list[Proposal]:
    """Draft a tree for several sessions at once: the catch-up and then every level are one
    ragged forward over all of them (each its own frontier, positions and tree mask).
    Greedy drafting scores candidates by the draft's softmax (T = 1); sampling by the
    request's own processed distribution."""
    decoder, shape = sessions[0].decoder, sessions[0].shape
    score = [tree_score_params(p) for p in params]
    for session in sessions:
        session.fed = 0
    logits = _catch_up_many(sessions, seqs)
    ranked = [[ranked_candidates(rows)] for rows in logits]
    trees = [TokenTree.root(seq[-1]).grow(torch.tensor([0]), probs_from_logits(rows[0], sp).unsqueeze(0),
                                          shape.topk, shape.width)
             for seq, rows, sp in zip(seqs, logits, score)]
    # Adaptive depth: a session's tree stops growing once its likeliest node of the last
    # level has a cumulative draft probability below ``stop``.
    reached = lambda tree, level: float(tree.score[tree.level(level)].max().exp()) if tree.level(level).numel() else 0.0  # noqa: E731
    stopped = {b for b, tree in enumerate(trees) if shape.stop and reached(tree, 1) < shape.stop}
    for level in range(2, shape.depth + 1):
        live = [b for b, tree in enumerate(trees) if b not in stopped and tree.level(level - 1).numel()]
        if not live:
            break
        frontiers = {b: trees[b].level(level - 1) for b in live}
        masks = [torch.cat([torch.ones(frontiers[b].numel(), sessions[b].committed, dtype=torch.bool),
                            trees[b].mask[frontiers[b]][:, 1 : int(frontiers[b][-1]) + 1]], dim=1) for b in live]
        out = decoder.forward_many(
            [trees[b].tokens[frontiers[b]] for b in live],
            [sessions[b].committed - 1 + trees[b].depth[frontiers[b]] for b in live],
            [sessions[b].cache for b in live], masks, [torch.arange(frontiers[b].numel()) for b in live])
        for b, rows in zip(live, out):
            sessions[b].fed = int(frontiers[b][-1])
            ranked[b].append(ranked_candidates(rows))
            trees[b] = trees[b].grow(frontiers[b], probs_from_logits(rows, score[b]), shape.topk, shape.width)
            if shape.stop and reached(trees[b], level) < shape.stop:
                stopped.add(b)
    return [Proposal(tree, None, torch.cat(ranks)) for tree, ranks in zip(trees, ranked)]


def batch_kind(session: DraftSession):
    """The function that drafts sessions like this one together, or None."""
    if isinstance(session, _ChainSession):
        return propose_chains
    if isinstance(session, _TreeSession):
        return propose_trees
    return None
