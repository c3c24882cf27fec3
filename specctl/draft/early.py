"""Answering a pre-speculation hit without waiting for the device (DESIGN §4).

A hit's answer needs only the tokens its branch has drafted, not the device. But the compute
thread that owns the branches is often in the middle of a background step when an outcome
arrives (on a GPU: kernels in flight; with ``--step-time-ms``: the emulated device's step),
and a Propose queued behind it waited for the step to end — 85-93 ms of a 570 ms round,
measured at d = 4 with 120 ms draft steps. So after every background step the compute thread
publishes, per plan, what each branch has drafted (copies, swapped in whole); the event loop
answers a Propose whose outcome a published branch holds, finished, at once, and queues the
adoption (the branch's KV becomes the session's; the next round is planned) for the compute
thread, which runs it before any further background step. The answer is the proposal the
compute thread would have sent, so the output is unchanged.

A partly drafted chain is answered from the event loop too, but only while a background step
is in flight (the compute thread would answer it after that step): with the tokens the last
published step left, j of them, whose last one, t_j, that very step is feeding. The commit,
after the step, cuts the branch back to those j tokens and keeps t_j's KV and the draft's
candidates after it: the proposal is then fed whole, so the next round's branches for a full
accept start at its first step instead of a step later (behind feeding t_j as a tail). The
target waits for no step. Measured (chain d = 6, 200 ms draft steps, a 650 ms verification,
N = 1): 1.42-1.46x plain against 1.40-1.41x, every text the same. An earlier try (2026-11-26,
reverted in 3e3f6fd: 1.31x against 1.43x) answered them without keeping that step's work: the
next round's branches came no earlier and a token shorter. Waiting for the step in flight when
its rest costs less than its token is worth (E(j)/Z against E(j+1)/(Z + r)) measured no better
(1.40-1.44x). Partly grown trees go through the compute thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specctl.draft.branches import ChainBranch
from specctl.draft.prespec import Plan, adopt, discard, proposal_of
from specctl.engine.tree import TokenTree
from specctl.spec.draft_state import DraftState
from specctl.spec.drafters import Proposal

Key = tuple[int, int]  # (the node the accepted path ends at, the bonus)


@dataclass(frozen=True, slots=True)
class DraftedBranch:
    """A branch as published: finished, or a chain with tokens drafted after its bonus."""
    tokens: tuple[int, ...]  # a chain: the bonus, then the tokens drafted after it
    probs: tuple[float, ...]
    dists: tuple[torch.Tensor, ...]  # q of each drafted token (sampled chains)
    tree: TokenTree | None  # a finished tree branch's tree; None for a chain
    drafted: int  # tokens (a chain) or levels (a tree) drafted after the bonus
    done: bool = True  # False: a chain still being drafted


@dataclass(frozen=True, slots=True)
class Published:
    """A plan's published branches as the event loop may read them."""
    plan: Plan
    branches: dict[Key, DraftedBranch]


@dataclass(frozen=True, slots=True)
class Ticket:
    """An answer sent from the event loop, for the compute thread to make the session's."""
    tag: int
    path: list[int]
    tokens: list[int]
    key: Key
    drafted: int
    plan: Plan
    answered_at: float
    max_depth: int = 0  # the target's cap, which the answer kept to
    partial: bool = False  # a chain answered with the tokens it had, while a step drafted on


def publish(plan: Plan) -> Published:
    """Copy the plan's finished branches and its chains with tokens after their bonus (on the
    compute thread, after a step)."""
    branches: dict[Key, DraftedBranch] = {}
    for key, branch in plan.branches.items():
        done = not branch.live(plan.depth)
        if not branch.slots or not (done or isinstance(branch, ChainBranch) and branch.levels >= 1):
            continue
        if isinstance(branch, ChainBranch):
            branches[key] = DraftedBranch(tuple(branch.tokens), tuple(branch.probs), tuple(branch.dists), None,
                                          branch.levels, done)
        else:
            branches[key] = DraftedBranch((), (), (), branch.tree, branch.levels)
    return Published(plan, branches)


def pick(published: Published, path: list[int], tokens: list[int],
         stepping: bool = False) -> tuple[Key, DraftedBranch] | None:
    """The published branch that answers this outcome, or None (a miss; a chain still being
    drafted while no background step is in flight (``stepping``), which the compute thread
    serves at once; an outcome that committed more than path and bonus: the compute thread decides)."""
    if len(tokens) != len(path) + 1:
        return None
    key = (path[-1] if path else 0, tokens[-1])
    branch = published.branches.get(key)
    return None if branch is None or not (branch.done or stepping) else (key, branch)


def proposal_for(branch: DraftedBranch, greedy: bool) -> Proposal:
    """The proposal the branch answers with (its wire message needs no ranked candidates)."""
    if branch.tree is not None:
        return Proposal(branch.tree)
    n = branch.drafted
    tree = TokenTree.chain(branch.tokens[0], list(branch.tokens[1:n + 1]), list(branch.probs[:n]))
    return Proposal(tree, None if greedy else torch.stack(branch.dists[:n]))


def commit(spec, state: DraftState, ticket: Ticket) -> Proposal:
    """On the compute thread: make the answered branch the session's, as a hit served there
    would; the session's new proposal."""
    plan = spec.outcome(ticket.tag, ticket.path, ticket.tokens)
    if plan is not ticket.plan:
        if plan is not None:
            discard(plan)
        raise RuntimeError(f"session {ticket.tag}: the plan its answer came from is gone")
    stats = spec.stats
    stats.hits += 1
    stats.early_answers += 1
    stats.hit_drafted += 1.0  # nothing of what was sent is left to draft
    stats.branches_used += 1
    stats.partial_hits += ticket.partial
    stats.short_answers += ticket.partial
    branch = plan.branches[ticket.key]
    if isinstance(branch, ChainBranch) and ticket.partial:
        branch.cut(ticket.drafted)  # what was sent; the step since fed its last token
    adopt(plan, ticket.key)
    state.advance(ticket.path, ticket.tokens, kv_done=True)
    return state.proposed_within_cap(proposal_of(plan))
