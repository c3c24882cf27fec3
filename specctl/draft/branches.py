"""Pre-speculation's branches (SSD / Saguaro, DESIGN §4): what one outcome's next proposal
holds while it is drafted — a chain (ChainBranch) or a tree of the session's top-k, width and
depth (TreeBranch) — and how each forward's logits grow it. A Plan (draft.prespec) owns them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Union

import torch

from specctl.engine.tree import TokenTree
from specctl.spec.drafters import ModelTreeDrafter, Proposal, ranked_candidates, tree_score_params, tree_shape
from specctl.spec.sampling import DRAFT_SUPPORT, keep_top, probs_from_logits, sample

if TYPE_CHECKING:
    from specctl.draft.prespec import Plan

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
    accepted: list[int] = field(default_factory=list)  # the accepted path's tokens (the request's rules read them)
    slots: list[int] = field(default_factory=list)  # KV slots of tokens[:len(slots)]
    probs: list[float] = field(default_factory=list)
    dists: list[torch.Tensor] = field(default_factory=list)  # q of each drafted token (sampling)
    ranked: list[torch.Tensor] = field(default_factory=list)
    stopped: bool = False  # adaptive depth stopped it, as it stops just-in-time drafting

    def live(self, depth: int) -> bool:
        return not self.stopped and len(self.tokens) <= depth

    @property
    def levels(self) -> int:
        """Tokens drafted after the bonus so far."""
        return len(self.tokens) - 1

    def drafted(self, depth: int) -> float:
        """The share of its proposal drafted so far (the bonus is given, d tokens follow it)."""
        return 1.0 if self.stopped else min(1.0, self.levels / depth)

    def rows(self) -> list[Row]:
        return [(self.tokens[len(self.slots)], self.position + len(self.slots), list(self.slots))]

    def absorb(self, plan: "Plan", slots: list[int], logits: torch.Tensor) -> None:
        self.slots += slots
        _draw(plan, self, guided(plan, logits[:1], [self.accepted + self.tokens])[0])

    def proposal(self, plan: "Plan") -> Proposal:
        params = plan.state.params
        return Proposal(TokenTree.chain(self.tokens[0], self.tokens[1:], self.probs),
                        None if params.greedy else torch.stack(self.dists), torch.stack(self.ranked))


@dataclass(slots=True)
class TreeBranch:
    trunk: list[int]
    position: int
    tree: TokenTree  # rooted at the bonus; grown level by level as the session's tree drafter would
    accepted: list[int] = field(default_factory=list)  # the accepted path's tokens (the request's rules read them)
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
        logits = guided(plan, logits, [self.accepted + self.tree.tokens[self.tree.path_to(int(j))].tolist()
                                       for j in frontier])
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


def guided(plan: "Plan", logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
    """Rows adjusted by the request's rules and grammar as the session's own drafting adjusts
    them (spec.logit_rules; ``paths``: each row's tokens past the text), or as they are when
    the session drafts free."""
    guide = getattr(plan.state.session, "guide", None)
    return logits if guide is None else guide.apply(logits, paths)


def _draw(plan: "Plan", branch: ChainBranch, row: torch.Tensor) -> None:
    state = plan.state
    position = len(branch.tokens) - 1
    branch.ranked.append(ranked_candidates(row))
    if state.params.greedy:  # the node's probability is the draft's softmax, as in a just-in-time chain
        x = int(row.argmax())  # on the logits, as just-in-time drafting does (softmax can round ties together)
        branch.tokens.append(x)
        branch.probs.append(float(row.float().softmax(-1)[x]))
    else:
        q = keep_top(probs_from_logits(row, state.params), DRAFT_SUPPORT)
        if plan.reshape is not None:
            q = plan.reshape(position, q)
        x = sample(q, state.generator)
        branch.tokens.append(x)
        branch.probs.append(float(q[x]))
        branch.dists.append(q)
    # Adaptive depth as batch_drafting.propose_chains applies it: the token that takes the
    # chain's probability below the session's stop is the last one drafted.
    stop = state.session.stop
    if stop and math.prod(branch.probs) < stop:
        branch.stopped = True
