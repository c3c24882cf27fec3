"""Pre-speculation's plans (SSD / Saguaro, DESIGN §4): while a target verifies a proposal
(a chain or a tree), draft the next proposal for its likely outcomes (draft.branches).

A Plan belongs to one session and its outstanding proposal. The draft's KV holds the text
and the proposal's nodes 1..fed (node j at slot base + j - 1, as after any proposal: every
node but the last level). An outcome is (v, bonus): the accepted path ends at node v, then
the target's bonus. Bonus candidates are the draft's top tokens after v without v's
children (a rejected candidate is never the bonus: the residual is zero there); for a node
of the last level, its top tokens once it is fed (a tail, fed first). Each step feeds every
live branch's next rows — all branches of all sessions in one forward — each row attending
to the text, the path to v and its own branch (a tree mask over trunk + fork). A branch
drafts what the session's drafter would: a chain (sampled at T > 0, Saguaro-reshaped when
C < 1) or a tree of the same top-k, width and depth. The branch that hits becomes the
session's KV (one gather); the others are dropped with the plan."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specctl.draft.branches import Branch, ChainBranch, Reshape, Row, TreeBranch, guided, kv_per_branch
from specctl.engine.tree import TokenTree
from specctl.spec.draft_state import DraftState
from specctl.spec.drafters import Proposal, ranked_candidates, tree_shape


@dataclass(slots=True)
class Plan:
    state: DraftState
    base: int  # text length when proposed: node j >= 1 sits at KV slot base + j - 1
    tree: TokenTree  # the outstanding proposal
    ranked: torch.Tensor  # [fed + 1, RANKED] the draft's candidates after each fed node, root first
    fanout: list[int]  # F_v for each node v
    depth: int  # how deep each branch drafts after its bonus
    reshape: Reshape | None = None
    branches: dict[tuple[int, int], Branch] = field(default_factory=dict)
    tails: list[int] = field(default_factory=list)  # last-level nodes with outcomes, still to feed
    tail_candidates: dict[int, list[int]] = field(default_factory=dict)  # the draft's candidates after each fed tail
    steps: int = 0
    started: int = 0  # branches that got at least one forward

    @property
    def fed(self) -> int:
        return self.ranked.shape[0] - 1

    @property
    def has_work(self) -> bool:
        return bool(self.tails) or any(b.live(self.depth) for b in self.branches.values())

    def children_tokens(self, node: int) -> set[int]:
        return {int(self.tree.tokens[c]) for c in self.tree.children(node)}

    def candidates_after(self, node: int) -> list[int] | None:
        """The draft's ranked candidates after ``node``: a fed node's from the proposal, a
        last-level node's once a step has fed it as a tail; None while they are not known."""
        return self.ranked[node].tolist() if node <= self.fed else self.tail_candidates.get(node)

    def rank_of(self, node: int, bonus: int) -> int | None:
        """The bonus's 0-based rank among the candidates after ``node`` (its children excluded:
        a rejected child is never the bonus), or None: not among them, or not known yet."""
        known = self.candidates_after(node)
        if known is None:
            return None
        taken = self.children_tokens(node)
        candidates = [t for t in known if t not in taken]
        return candidates.index(bonus) if bonus in candidates else None

    def _open(self, node: int, candidates: list[int]) -> None:
        taken = self.children_tokens(node)
        for token in [t for t in candidates if t not in taken][: self.fanout[node]]:
            self.branches[(node, token)] = self._branch(node, token)

    def _branch(self, node: int, bonus: int) -> Branch:
        path = self.tree.path_to(node)[1:]
        trunk = [self.base + a - 1 for a in path]
        accepted = self.tree.tokens[path].tolist() if path else []
        position = self.base + int(self.tree.depth[node])
        if tree_shape(self.state.session) is None:
            return ChainBranch(trunk, position, [bonus], accepted=accepted)
        return TreeBranch(trunk, position, TokenTree.root(bonus), accepted=accepted)

    def open_outcome(self, node: int, bonus: int) -> Branch | None:
        """A branch for an outcome nothing was planned for, drafted from its bonus like any
        other (a miss drafted in the background's forwards), or None: the node's KV is not
        there yet (a last-level node before its tail was fed), or the bonus is one of its
        children (never a bonus)."""
        if self.candidates_after(node) is None or bonus in self.children_tokens(node):
            return None
        branch = self.branches[(node, bonus)] = self._branch(node, bonus)
        return branch


def make_plan(state: DraftState, proposal: Proposal, fanout: list[int], depth: int,
              reshape: Reshape | None = None) -> Plan | None:
    """The branches to draft for this proposal's outcomes, or None when it cannot have any
    (no candidates, or no KV room left for them)."""
    tree, ranked = proposal.tree, proposal.ranked
    cache = state.session.cache
    base = len(state.seq)
    if len(tree) < 2 or ranked is None or len(fanout) != len(tree) or cache.length != base + ranked.shape[0] - 1:
        return None
    plan = Plan(state, base, tree, ranked, fanout, depth, reshape)
    plan.tails = list(range(plan.fed + 1, len(tree)))  # all of them: node j lands at slot base + j - 1
    if not any(fanout[v] for v in plan.tails):
        plan.tails = []
    if cache.length + len(plan.tails) + sum(fanout) * kv_per_branch(tree_shape(state.session), depth) > cache.capacity:
        return None
    for node in range(plan.fed + 1):
        plan._open(node, ranked[node].tolist())
    return plan


def live_rows(plan: Plan) -> int:
    """Rows the plan's next step feeds: its tails and its live branches' next rows."""
    return len(plan.tails) + sum(len(b.rows()) for b in plan.branches.values() if b.live(plan.depth))


def step(plans: list[Plan], max_rows: int | None = None) -> list[Plan]:
    """One draft forward that advances every live branch of ``plans`` by one token or tree
    level (up to ``max_rows`` rows; the plans beyond wait for the next step). Returns the
    plans advanced."""
    work: list[tuple[Plan, int, list]] = []
    inputs, positions, caches, masks = [], [], [], []
    total = 0
    for plan in plans:
        owners: list = []
        rows: list[Row] = []
        for node in plan.tails:  # first, in node order: node j lands at slot base + j - 1
            owners.append(node)
            rows.append((int(plan.tree.tokens[node]), plan.base - 1 + int(plan.tree.depth[node]),
                         [plan.base + a - 1 for a in plan.tree.path_to(node)[1:-1]]))
        for branch in plan.branches.values():
            if branch.live(plan.depth):
                for token, position, attend in branch.rows():
                    owners.append(branch)
                    rows.append((token, position, branch.trunk + attend))
        if not rows or (max_rows is not None and total and total + len(rows) > max_rows):
            continue
        cache = plan.state.session.cache
        start, n = cache.length, len(rows)
        mask = torch.zeros(n, start + n, dtype=torch.bool)
        for i, (_, _, attend) in enumerate(rows):
            mask[i, : plan.base] = True
            mask[i, attend] = True
            mask[i, start + i] = True
        inputs.append(torch.tensor([token for token, _, _ in rows], dtype=torch.long))
        positions.append(torch.tensor([position for _, position, _ in rows], dtype=torch.long))
        caches.append(cache)
        masks.append(mask)
        work.append((plan, start, owners))
        total += n
    if not work:
        return []
    decoder = work[0][0].state.session.decoder
    out = decoder.forward_many(inputs, positions, caches, masks, [torch.arange(len(owners)) for _, _, owners in work])
    for (plan, start, owners), logits in zip(work, out):
        plan.steps += 1
        plan.tails = []
        i = 0
        while i < len(owners):
            owner, j = owners[i], i + 1
            while j < len(owners) and owners[j] is owner and not isinstance(owner, int):
                j += 1
            if isinstance(owner, int):  # a tail: its outcomes' branches start here
                path = plan.tree.tokens[plan.tree.path_to(owner)[1:]].tolist()
                plan.tail_candidates[owner] = ranked_candidates(guided(plan, logits[i : i + 1], [path])[0]).tolist()
                plan._open(owner, plan.tail_candidates[owner])
            else:
                plan.started += not owner.slots
                owner.absorb(plan, list(range(start + i, start + j)), logits[i:j])
            i = j
    return [plan for plan, _, _ in work]


def adopt(plan: Plan, key: tuple[int, int]) -> Branch:
    """Make the branch ``key`` the session's KV (text + its path + its slots, compacted) and
    drop every other branch; it keeps drafting from there if it is not finished."""
    branch = plan.branches[key]
    session = plan.state.session
    session.cache.gather(list(range(plan.base)) + branch.trunk + branch.slots)
    bonus_at = plan.base + len(branch.trunk)
    branch.trunk = list(range(plan.base, bonus_at))
    branch.slots = list(range(bonus_at, bonus_at + len(branch.slots)))
    plan.branches, plan.tails = {key: branch}, []
    session.committed = bonus_at + 1  # text + the accepted path + the bonus
    return branch


def discard(plan: Plan) -> None:
    """Drop every branch's KV (a miss, or no outcome to use it for): the session's cache goes
    back to the text and the proposal's fed nodes. Branch and tail slots follow them, so a
    later cut to text + accepted must never keep one as if it were a proposal node."""
    cache = plan.state.session.cache
    cache.truncate(min(cache.length, plan.base + plan.fed))


def proposal_of(plan: Plan) -> Proposal:
    """The adopted branch's proposal (once ``SpeculationCache._finish`` drafted it); the
    session's drafting state now describes the KV the branch left."""
    return next(iter(plan.branches.values())).proposal(plan)
