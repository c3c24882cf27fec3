"""Pre-speculation's branches (SSD / Saguaro, DESIGN §4): while a target verifies chain
proposal x_1..x_d, draft the next proposal for its likely outcomes.

A Plan belongs to one session and its outstanding chain (the draft's KV holds the text and
x_1..x_{d-1}, as after any chain proposal). Its branches are keyed (k, bonus): k tokens
accepted, then the target's bonus. For k < d the bonus candidates are the draft's top
tokens at position k+1 without x_{k+1} (a rejected token is never the bonus: the residual
is zero there); for k = d, the top tokens after x_d, which is fed first. Each step feeds
every live branch's last token — all branches of all sessions in one forward — each
attending to its trunk prefix and its own path (a tree mask over trunk + fork), and draws
its next token. The branch that hits becomes the session's KV (one gather); the others
are dropped with the plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from specctl.engine.tree import TokenTree
from specctl.spec.draft_state import DraftState
from specctl.spec.drafters import RANKED, Proposal
from specctl.spec.sampling import DRAFT_SUPPORT, SamplingParams, keep_top, probs_from_logits, sample

Reshape = Callable[[int, torch.Tensor], torch.Tensor]  # (position, q) -> the q to sample from


@dataclass(slots=True)
class Branch:
    prefix: int  # trunk positions it attends to: the text and x_1..x_k
    tokens: list[int]  # the bonus, then the tokens drafted after it
    slots: list[int] = field(default_factory=list)  # KV slots of tokens[:len(slots)]
    probs: list[float] = field(default_factory=list)
    dists: list[torch.Tensor] = field(default_factory=list)  # q of each drafted token (sampling)
    ranked: list[torch.Tensor] = field(default_factory=list)

    def live(self, depth: int) -> bool:
        return len(self.tokens) <= depth


@dataclass(slots=True)
class Plan:
    state: DraftState
    base: int  # text length when proposed: x_1 sits at position base
    chain: list[int]  # the outstanding proposal x_1..x_d
    ranked: torch.Tensor  # [d, RANKED] the draft's candidates at each of its positions
    fanout: list[int]  # F_0..F_d
    depth: int  # tokens each branch drafts after its bonus
    reshape: Reshape | None = None
    branches: dict[tuple[int, int], Branch] = field(default_factory=dict)
    tail: int | None = None  # x_d, still to feed (the full-accept candidates follow it)
    tail_fed: bool = False
    steps: int = 0
    started: int = 0  # branches that got at least one forward

    @property
    def has_work(self) -> bool:
        return self.tail is not None or any(b.live(self.depth) for b in self.branches.values())

    def rank_of(self, k: int, bonus: int) -> int | None:
        """The bonus's 0-based rank among the candidates for k accepted, or None."""
        if k >= len(self.chain):
            return None
        candidates = [t for t in self.ranked[k].tolist() if t != self.chain[k]]
        return candidates.index(bonus) if bonus in candidates else None


def make_plan(state: DraftState, proposal: Proposal, fanout: list[int], depth: int,
              reshape: Reshape | None = None) -> Plan | None:
    """The branches to draft for this chain proposal's outcomes, or None when it cannot
    have any (no candidates, or no KV room left for them)."""
    chain = proposal.tree.tokens[1:].tolist()
    cache = state.session.cache
    base = len(state.seq)
    if not chain or proposal.ranked is None or len(fanout) != len(chain) + 1 or cache.length != base + len(chain) - 1:
        return None
    if cache.length + 1 + sum(fanout) * depth > cache.capacity:
        return None
    plan = Plan(state, base, chain, proposal.ranked, fanout, depth, reshape)
    for k, count in enumerate(fanout[:-1]):
        for token in [t for t in proposal.ranked[k].tolist() if t != chain[k]][:count]:
            plan.branches[(k, token)] = Branch(base + k, [token])
    plan.tail = chain[-1] if fanout[-1] > 0 else None
    return plan


def step(plans: list[Plan], max_rows: int | None = None) -> list[Plan]:
    """One draft forward that advances every live branch of ``plans`` by one token (up to
    ``max_rows`` rows; the plans beyond wait for the next step). Returns the plans advanced."""
    work: list[tuple[Plan, int, list[Branch | None]]] = []
    inputs, positions, caches, masks = [], [], [], []
    total = 0
    for plan in plans:
        rows: list[Branch | None] = [None] if plan.tail is not None else []
        rows += [b for b in plan.branches.values() if b.live(plan.depth)]
        if not rows or (max_rows is not None and total and total + len(rows) > max_rows):
            continue
        cache = plan.state.session.cache
        start, n = cache.length, len(rows)
        mask = torch.zeros(n, start + n, dtype=torch.bool)
        tokens, where = [], []
        for i, branch in enumerate(rows):
            if branch is None:  # x_d: right after the trunk, before any branch slot
                mask[i, : start + 1] = True
                tokens.append(plan.tail)
                where.append(plan.base + len(plan.chain) - 1)
            else:
                mask[i, : branch.prefix] = True
                mask[i, branch.slots] = True
                mask[i, start + i] = True
                tokens.append(branch.tokens[len(branch.slots)])
                where.append(branch.prefix + len(branch.slots))
        inputs.append(torch.tensor(tokens, dtype=torch.long))
        positions.append(torch.tensor(where, dtype=torch.long))
        caches.append(cache)
        masks.append(mask)
        work.append((plan, start, rows))
        total += n
    if not work:
        return []
    decoder = work[0][0].state.session.decoder
    out = decoder.forward_many(inputs, positions, caches, masks, [torch.arange(len(rows)) for _, _, rows in work])
    for (plan, start, rows), logits in zip(work, out):
        plan.steps += 1
        for i, (branch, row) in enumerate(zip(rows, logits)):
            if branch is None:
                plan.tail, plan.tail_fed = None, True
                k = len(plan.chain)
                for token in row.topk(min(RANKED, row.shape[-1])).indices.tolist()[: plan.fanout[-1]]:
                    plan.branches[(k, token)] = Branch(plan.base + k, [token])
            else:
                plan.started += not branch.slots
                branch.slots.append(start + i)
                _draw(plan, branch, row)
    return [plan for plan, _, _ in work]


def _draw(plan: Plan, branch: Branch, row: torch.Tensor) -> None:
    state = plan.state
    position = len(branch.tokens) - 1
    branch.ranked.append(row.topk(min(RANKED, row.shape[-1])).indices)
    if state.params.greedy:  # the node's probability is the draft's softmax, as in a just-in-time chain
        x = int(row.argmax())  # on the logits, as just-in-time drafting does (softmax can round ties together)
        branch.tokens.append(x)
        branch.probs.append(float(row.float().softmax(-1)[x]))
        return
    q = keep_top(probs_from_logits(row, state.params), DRAFT_SUPPORT)
    if plan.reshape is not None:
        q = plan.reshape(position, q)
    x = sample(q, state.generator)
    branch.tokens.append(x)
    branch.probs.append(float(q[x]))
    branch.dists.append(q)


def adopt(plan: Plan, key: tuple[int, int]) -> Branch:
    """Make the branch ``key`` the session's KV (trunk prefix + its slots, compacted) and
    drop every other branch; it keeps drafting from there if it is not finished."""
    branch = plan.branches[key]
    cache = plan.state.session.cache
    cache.gather(list(range(branch.prefix)) + branch.slots)
    branch.slots = list(range(branch.prefix, branch.prefix + len(branch.slots)))
    plan.branches, plan.tail = {key: branch}, None
    plan.state.session.committed = branch.prefix + 1  # text + x_1..x_k + the bonus
    return branch


def discard(plan: Plan) -> None:
    """Drop every branch's KV (a miss, or no outcome to use it for): the session's cache goes
    back to its trunk — the text, x_1..x_{d-1} and x_d if it was fed. Branch slots follow
    the trunk, so a later cut to text + k accepted must never keep one as if it were x_k."""
    cache = plan.state.session.cache
    cache.truncate(min(cache.length, plan.base + len(plan.chain) - 1 + plan.tail_fed))


def finish(plans: list[Plan]) -> None:
    """Draft the adopted branches to full depth (a hit that arrived before they were done)."""
    while any(plan.has_work for plan in plans):
        step([plan for plan in plans if plan.has_work])


def proposal_of(branch: Branch, params: SamplingParams) -> Proposal:
    drafted = branch.tokens[1:]
    return Proposal(TokenTree.chain(branch.tokens[0], drafted, branch.probs),
                    None if params.greedy else torch.stack(branch.dists), torch.stack(branch.ranked))
