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

A partly drafted branch still goes through the compute thread, after the step in flight,
which may well be drafting its next token: answering it early with what the last published
step left (``fanout.answer_now`` on those tokens) measured 1.21x against 1.43x — proposals of
2.4 tokens against 3.5 (d = 4, 120 ms steps, a 410 ms verification). Tried again (2026-12-07),
answering it while the step in flight feeds its last token and keeping that KV (the proposal
fed whole, the next round's branches all open at once): 1.40x -> 1.43x at N = 1 and 1.53x ->
1.55x at N = 2 (d = 6, 200 ms steps, a 650 ms verification), but at N = 3 = N_full two of three
repeats fell to 0.92-0.97x (hit rate 25-41 %: with every branch opened at once the steps crowd,
misses drafted just in time hold the draft, more plans starve); reverted (docs/BENCHMARKS.md)."""

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
    """A finished branch, as published."""
    tokens: tuple[int, ...]  # a chain: the bonus, then the tokens drafted after it
    probs: tuple[float, ...]
    dists: tuple[torch.Tensor, ...]  # q of each drafted token (sampled chains)
    tree: TokenTree | None  # a finished tree branch's tree; None for a chain
    drafted: int  # tokens (a chain) or levels (a tree) drafted after the bonus


@dataclass(frozen=True, slots=True)
class Published:
    """A plan's finished branches as the event loop may read them."""
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


def publish(plan: Plan) -> Published:
    """Copy the plan's finished branches (on the compute thread, after a step)."""
    branches: dict[Key, DraftedBranch] = {}
    for key, branch in plan.branches.items():
        if not branch.slots or branch.live(plan.depth):
            continue
        if isinstance(branch, ChainBranch):
            branches[key] = DraftedBranch(tuple(branch.tokens), tuple(branch.probs), tuple(branch.dists), None,
                                          branch.levels)
        else:
            branches[key] = DraftedBranch((), (), (), branch.tree, branch.levels)
    return Published(plan, branches)


def pick(published: Published, path: list[int], tokens: list[int]) -> tuple[Key, DraftedBranch] | None:
    """The finished branch that answers this outcome, or None (a miss, a branch still being
    drafted, or an outcome that committed more than path and bonus: the compute thread decides)."""
    if len(tokens) != len(path) + 1:
        return None
    key = (path[-1] if path else 0, tokens[-1])
    branch = published.branches.get(key)
    return None if branch is None else (key, branch)


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
    stats.hit_drafted += 1.0
    stats.branches_used += 1
    adopt(plan, ticket.key)
    state.advance(ticket.path, ticket.tokens, kv_done=True)
    return state.proposed_within_cap(proposal_of(plan))
