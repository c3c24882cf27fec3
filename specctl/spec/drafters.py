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

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from specctl.engine.kv_cache import KVPool
from specctl.engine.model import Decoder
from specctl.engine.tree import PlainTree, TokenTree
from specctl.spec.params import SamplingParams


@dataclass(frozen=True, slots=True)
class Proposal:
    # a plain tree where the event loop made the proposal (off the wire, fused): built() makes
    # its tensors on the compute thread, before verification
    tree: TokenTree | PlainTree
    # q for each chain position when the chain's tokens were sampled from it: [len(tree)-1, V], or
    # what makes it on the compute thread (a remote proposal's sparse rows: spec.verify.accept_proposal)
    draft_probs: torch.Tensor | Callable[[], torch.Tensor] | None = None
    # The draft's candidates after each node in its KV (every node but the last level: a
    # chain's x_0..x_{d-1}), likeliest first: [fed + 1, RANKED] token ids (pre-speculation
    # guesses the bonus token among them)
    ranked: torch.Tensor | None = None

    def built(self) -> "Proposal":
        """This proposal with a TokenTree (on the compute thread: it makes tensors)."""
        return self if isinstance(self.tree, TokenTree) else dataclasses.replace(self, tree=self.tree.built())


RANKED = 16  # candidates a model drafter keeps per node it feeds


def first_levels(proposal: Proposal, depth: int) -> Proposal:
    """The proposal's first ``depth`` levels (0: all of it): a proposal drafted deeper than
    the target now asks for (a pre-speculated branch) answers with its prefix, which is
    verified as losslessly. Its q and ranked rows follow: the ranked ones of the nodes above
    the last level kept, which a proposal of that depth would have fed."""
    tree = proposal.tree
    if not depth or tree.max_depth <= depth:
        return proposal
    if not isinstance(tree, TokenTree) or callable(proposal.draft_probs):
        raise TypeError("first_levels cuts a drafted proposal (a TokenTree, its q a tensor)")
    cut = tree.first_levels(depth)
    above = int((tree.depth < depth).sum())
    q, ranked = proposal.draft_probs, proposal.ranked
    return Proposal(cut, None if q is None else q[: len(cut) - 1], None if ranked is None else ranked[:above])


def ranked_candidates(logits: torch.Tensor) -> torch.Tensor:
    """The draft's RANKED likeliest tokens after each row of ``logits``, likeliest first."""
    return logits.topk(min(RANKED, logits.shape[-1]), dim=-1).indices


class DraftSession:
    def propose(self, seq: list[int], params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        raise NotImplementedError

    def on_verified(self, path: list[int]) -> None:
        """``path``: accepted node indices of the last proposal (root excluded)."""

    def rounds_between(self) -> None:
        """Rounds another speculator proposed in (a request's prediction) came between the last
        proposal and the outcome about to be told: a drafter that times its rounds leaves that
        one unmeasured."""

    def observe(self, seq: list[int]) -> None:
        """The session's text as it stands, between proposals or at its end (a drafter that
        learns from text, suffix decoding, indexes it; a model drafter needs nothing)."""

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
        self.guide = None  # the request's logit rules and grammar, followed while drafting (spec.logit_rules)
        self.looked_up = False  # the prefix cache was asked for the prompt's start (once, before any feeding)

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
        self.depth_cap = 0  # the next proposal at most this deep (0: depth), as the target's load asks
        self.committed = 0
        # (position, q) -> the q to sample from instead (Saguaro sampling); None = q itself
        self.reshape: Callable[[int, torch.Tensor], torch.Tensor] | None = None

    def propose(self, seq, params, generator):
        from specctl.spec.batch_drafting import propose_chains  # it imports this module

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
        self.depth_cap = 0  # the next proposal at most this deep (0: the shape's depth), as the target's load asks
        self.committed = 0
        self.fed = 0  # tree nodes 1..fed are in the cache at positions committed + (node - 1)

    def propose(self, seq, params, generator):
        from specctl.spec.batch_drafting import propose_trees  # it imports this module

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

    def lookup(self, seq: list[int], depth: int = 0) -> list[int]:
        """``depth``: at most this many tokens (0: the drafter's depth)."""
        depth = min(depth or self.depth, self.depth)
        n_seq = len(seq)
        for n in range(min(self.max_ngram, n_seq - 1), self.min_ngram - 1, -1):
            pattern, longest = seq[n_seq - n :], []
            for start in range(n_seq - n - 1, -1, -1):
                if seq[start : start + n] == pattern:
                    follow = seq[start + n : start + n + depth]
                    if len(follow) == depth:
                        return follow
                    if len(follow) > len(longest):
                        longest = follow
            if longest:
                return longest
        return []

    def open(self, capacity: int, pool: KVPool | None = None) -> DraftSession:
        drafter = self

        class _Session(DraftSession):
            depth_cap = 0  # the next proposal at most this deep (0: the drafter's depth), as the target's load asks

            def propose(self, seq, params, generator):
                return Proposal(TokenTree.chain(seq[-1], drafter.lookup(seq, self.depth_cap)))

        return _Session()
