"""The draft side of one session, wherever the draft runs: the draft session, the committed
text it drafts from and the proposal it last made. A round's outcome (accepted node
indices + the tokens it committed) is applied here, and only here, whether it arrives as a
Propose message on a draft server or from the one-process round loop; an outcome that does
not fit the last proposal is refused before it reaches the model."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from specctl.engine.spec import check_token_ids
from specctl.engine.tree import TokenTree
from specctl.errors import BadRequest
from specctl.spec.batch_drafting import batch_kind
from specctl.spec.drafters import DraftSession, Proposal, first_levels
from specctl.spec.params import SamplingParams


def draft_capacity(prompt_tokens: int, max_tokens: int, max_nodes: int) -> int:
    """Positions a draft session reserves: the text it may see plus a proposal drafted past
    its end, plus the outcome that arrives before it is cut back."""
    return prompt_tokens + max_tokens + 2 * max_nodes + 2


@dataclass(slots=True)
class DraftState:
    session: DraftSession
    params: SamplingParams
    generator: torch.Generator
    seq: list[int]  # committed text; its last token is the next proposal's root
    capacity: int  # positions the session reserved (prompt + max_tokens + room for proposals)
    max_nodes: int  # the drafter's largest proposal (root included)
    vocab_size: int
    last_tree: TokenTree | None = None  # the proposal the next outcome answers, if any
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    # (tokens or levels proposed, accepted) of its recent rounds: acceptance by position
    outcomes: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))
    # A seeded sampled request's (SamplingParams.repeatable). Its sample depends on the draft's
    # q through the acceptance test, and a bf16 draft's q changes in the last bits with how its
    # KV was computed: a restored prefix (decode steps' bits, not a prefill's) or rows batched
    # with other sessions (a one-row product takes another kernel). So such a session restores
    # no cached prefix, is drafted on its own, and is never pre-speculated (draft.sessions):
    # its seed repeats the text under any load, at the cost of those savings for it alone.
    reproducible: bool = False

    def __post_init__(self) -> None:
        if self.reproducible and hasattr(self.session, "looked_up"):
            self.session.looked_up = True  # its prompt is fed from the start, never restored
        # the prefix cache's namespace of its model drafts' caches (vLLM's cache_salt; several
        # drafters: each of theirs)
        for one in getattr(self.session, "sessions", [self.session]):
            if hasattr(one, "cache"):
                one.cache.salt = self.params.cache_salt

    def check_outcome(self, path: list[int], tokens: list[int]) -> None:
        """Refuse an outcome that is not one the last proposal could have had: BadRequest."""
        check_token_ids(tokens, self.vocab_size)
        if not tokens:
            raise BadRequest("an outcome must commit at least one token (the bonus, or the first token after a prompt)")
        if len(self.seq) + len(tokens) + self.max_nodes > self.capacity:
            raise BadRequest(f"the session grew past the {self.capacity} positions it reserved")
        tree = self.last_tree
        if tree is None:
            if path:
                raise BadRequest("an accepted path was sent but no proposal is outstanding")
            return
        # The accepted tokens, the bonus, and (when the target fused other drafters' tokens into
        # the round, or skipped this draft for some rounds) the text committed after them.
        if len(tokens) < len(path) + 1:
            raise BadRequest(f"an outcome of {len(path)} accepted nodes commits at least {len(path) + 1} tokens, "
                             f"got {len(tokens)}")
        parent = 0
        for node, token in zip(path, tokens):
            if not 0 < node < len(tree) or int(tree.parents[node]) != parent:
                raise BadRequest(f"accepted path {path} is not a root-to-leaf path of the last proposal")
            if int(tree.tokens[node]) != token:
                raise BadRequest(f"token {token} at node {node} differs from the proposed {int(tree.tokens[node])}")
            parent = node

    def advance(self, path: list[int], tokens: list[int], kv_done: bool = False) -> None:
        """Apply the last round's outcome (checked first) to the draft's KV and text;
        ``kv_done``: the KV already holds the outcome (a pre-speculated branch was adopted)."""
        self.check_outcome(path, tokens)
        if self.last_tree is not None:
            if not kv_done:
                self.session.on_verified(path)
            self.rounds += 1
            self.drafted += self.last_tree.max_depth
            self.accepted += len(path)
            self.outcomes.append((int(self.last_tree.max_depth), len(path)))
            self.last_tree = None
        self.seq.extend(tokens)
        guide = getattr(self.session, "guide", None)  # the request's logit rules, which the draft follows
        if guide is not None:
            guide.record(tokens)

    def cap_depth(self, max_depth: int) -> None:
        """The next proposal at most ``max_depth`` tokens deep (0: the drafter's own depth): the
        target's load (spec.turns). Model chains and trees, n-gram and suffix lookups, several
        drafters (each of theirs)."""
        if max_depth < 0:
            raise BadRequest(f"max_depth must be >= 0 (0: the draft's own depth), got {max_depth}")
        if hasattr(self.session, "depth_cap"):
            self.session.depth_cap = max_depth

    def proposed(self, proposal: Proposal) -> Proposal:
        self.last_tree = proposal.tree
        return proposal

    def proposed_within_cap(self, proposal: Proposal) -> Proposal:
        """``proposed`` for a proposal drafted before the target's last cap (a pre-speculated
        branch): cut to the cap, the KV kept to the nodes the cut proposal feeds (the text and
        the nodes above its last level), as a proposal drafted at that depth leaves it."""
        cut = first_levels(proposal, getattr(self.session, "depth_cap", 0))
        if cut is not proposal:
            fed = int((cut.tree.depth < cut.tree.max_depth).sum()) - 1  # nodes 1..fed sit after the text
            cache = self.session.cache
            cache.truncate(min(cache.length, len(self.seq) + fed))
            if hasattr(self.session, "fed"):  # a tree session's record of its nodes' KV
                self.session.fed = min(self.session.fed, fed)
        return self.proposed(cut)

    def close(self) -> None:
        session = self.session
        prefixes = getattr(getattr(session, "decoder", None), "prefix_cache", None)
        # the cache's first positions hold seq[:committed]; before the first proposal, the prompt's
        # chunks fed so far (kept for a retry of a request given up mid-prefill)
        committed = getattr(session, "committed", 0) or getattr(getattr(session, "cache", None), "length", 0)
        if prefixes is not None and committed and not session.cache.released:
            prefixes.store(self.seq[:committed], session.cache)
        session.close()


def draft_many(states: list[DraftState]) -> list[Proposal | Exception]:
    """Draft for several sessions in one pass: chain sessions together and tree sessions
    together (one forward per step or level for all of them), anything else and a
    reproducible session one at a time. One proposal or exception per state, in order."""
    results: list[Proposal | Exception | None] = [None] * len(states)
    groups: dict = {}
    for i, state in enumerate(states):  # a reproducible session alone (DraftState.reproducible)
        groups.setdefault((batch_kind(state.session), i if state.reproducible else None), []).append(i)
    for (together, _), members in groups.items():
        batch = [states[i] for i in members]
        if together is None:
            proposals = [_propose_one(s) for s in batch]
        else:
            try:
                proposals = together([s.session for s in batch], [s.seq for s in batch],
                                     [s.params for s in batch], [s.generator for s in batch])
            except Exception as exc:  # noqa: BLE001 - handed to every session of the group
                proposals = [exc] * len(batch)
        for i, state, proposal in zip(members, batch, proposals):
            results[i] = proposal if isinstance(proposal, Exception) else state.proposed(proposal)
    return results


def _propose_one(state: DraftState) -> Proposal | Exception:
    try:
        return state.session.propose(state.seq, state.params, state.generator)
    except Exception as exc:  # noqa: BLE001 - that session's only
        return exc
