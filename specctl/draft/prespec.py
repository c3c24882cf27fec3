"""Pre-speculation's branches (SSD / Saguaro, DESIGN §4): while a target verifies a proposal
(a chain or a tree), draft the next proposal for its likely outcomes.

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
from typing import Callable, Union

import torch

from specctl.engine.tree import TokenTree
from specctl.spec.draft_state import DraftState
from specctl.spec.drafters import ModelTreeDrafter, Proposal, ranked_candidates, tree_score_params, tree_shape
from specctl.spec.sampling import DRAFT_SUPPORT, keep_top, probs_from_logits, sample

Reshape = Callable[[int, torch.Tensor], torch.Tensor]  # (position, q) -> the q to sample from
Row = tuple[int, int, list[int]]  # (token, position, KV slots it attends to besides the text and itself)


def kv_per_branch(shape: ModelTreeDrafter | None, depth: int) -> int:
    """KV slots one branch can fill: a chain's bonus and the d - 1 tokens fed after it; a
    tree's nodes but its last level (the bonus is its root)."""
    return depth if shape is None else shape.max_nodes - shape.width


@dataclass(slots=True)
class ChainBranch:
    trunk: list[int]  # KV slots of the accepted path (the text is attended to as well)
    position: int  # the bonus's position
    tokens: list[int]  # the bonus, then the tokens drafted after it
    slots: list[int] = field(default_factory=list)  # KV slots of tokens[:len(slots)]
    probs: list[float] = field(default_factory=list)
    dists: list[torch.Tensor] = field(default_factory=list)  # q of each drafted token (sampling)
    ranked: list[torch.Tensor] = field(default_factory=list)

    def live(self, depth: int) -> bool:
        return len(self.tokens) <= depth

    @property
    def levels(self) -> int:
        """Tokens drafted after the bonus so far."""
        return len(self.tokens) - 1

    def drafted(self, depth: int) -> float:
        """The share of its proposal drafted so far (the bonus is given, d tokens follow it)."""
        return min(1.0, self.levels / depth)

    def rows(self) -> list[Row]:
        return [(self.tokens[len(self.slots)], self.position + len(self.slots), list(self.slots))]

    def absorb(self, plan: "Plan", slots: list[int], logits: torch.Tensor) -> None:
        self.slots += slots
        _draw(plan, self, logits[0])

    def proposal(self, plan: "Plan") -> Proposal:
        params = plan.state.params
        return Proposal(TokenTree.chain(self.tokens[0], self.tokens[1:], self.probs),
                        None if params.greedy else torch.stack(self.dists), torch.stack(self.ranked))


@dataclass(slots=True)
class TreeBranch:
    trunk: list[int]
    position: int
    tree: TokenTree  # rooted at the bonus; grown level by level as the session's tree drafter would
    slots: list[int] = field(default_factory=list)  # KV slot of node j, for the nodes fed so far
    ranked: list[torch.Tensor] = field(default_factory=list)
    done: bool = False  # adaptive depth stopped it

    def live(self, depth: int) -> bool:
        return not self.done and len(self.slots) < len(self.tree) and self.tree.max_depth < depth

    @property
    def levels(self) -> int:
        """Levels grown below the bonus so far."""
        return int(self.tree.max_depth)

    def drafted(self, depth: int) -> float:
        """The share of its proposal drafted so far: its levels grown out of d."""
        return 1.0 if not self.live(depth) else min(1.0, self.levels / depth)

    def rows(self) -> list[Row]:
        return [(int(self.tree.tokens[j]), self.position + int(self.tree.depth[j]),
                 [self.slots[a] for a in self.tree.path_to(j)[:-1]]) for j in range(len(self.slots), len(self.tree))]

    def absorb(self, plan: "Plan", slots: list[int], logits: torch.Tensor) -> None:
        shape = tree_shape(plan.state.session)
        frontier = torch.arange(len(self.slots), len(self.tree))
        self.slots += slots
        self.ranked += list(ranked_candidates(logits))
        self.tree = self.tree.grow(frontier, probs_from_logits(logits, tree_score_params(plan.state.params)),
                                   shape.topk, shape.width)
        level = self.tree.level(self.tree.max_depth)
        if shape.stop and (int(level.numel()) == 0 or float(self.tree.score[level].max().exp()) < shape.stop):
            self.done = True

    def proposal(self, plan: "Plan") -> Proposal:
        plan.state.session.fed = len(self.slots) - 1  # the tree session's own record of its KV
        return Proposal(self.tree, None, torch.stack(self.ranked))


Branch = Union[ChainBranch, TreeBranch]


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
        trunk = [self.base + a - 1 for a in self.tree.path_to(node)[1:]]
        position = self.base + int(self.tree.depth[node])
        if tree_shape(self.state.session) is None:
            return ChainBranch(trunk, position, [bonus])
        return TreeBranch(trunk, position, TokenTree.root(bonus))

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
                plan.tail_candidates[owner] = ranked_candidates(logits[i]).tolist()
                plan._open(owner, plan.tail_candidates[owner])
            else:
                plan.started += not owner.slots
                owner.absorb(plan, list(range(start + i, start + j)), logits[i:j])
            i = j
    return [plan for plan, _, _ in work]


def _draw(plan: Plan, branch: ChainBranch, row: torch.Tensor) -> None:
    state = plan.state
    position = len(branch.tokens) - 1
    branch.ranked.append(ranked_candidates(row))
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
