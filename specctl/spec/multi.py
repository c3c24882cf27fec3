"""Several drafters for one target (CoSine): a Drafter whose sessions route each round to
the drafters that do best on this session (``spec.routing``) and fuse their chains into one
tree (``spec.fusion``). A drafter that fails is skipped for that round (its failure is
counted); if all fail the round verifies the root alone. Lossless like every tree: greedy
output is the target's, and sampled requests get deterministic candidates (each drafter
drafts greedily) verified by recursive rejection, so no q is ever passed that was not
sampled from."""

from __future__ import annotations

import logging

from specctl.engine.kv_cache import KVPool
from specctl.engine.tree import TokenTree
from specctl.spec.drafters import DraftSession, Drafter, ModelTreeDrafter, Proposal
from specctl.spec.fusion import accepted_prefix, fuse_chains
from specctl.spec.routing import DrafterStats, RoutingPolicy, RoutingScore, choose_drafters, next_drafter
from specctl.spec.sampling import SamplingParams, uniform

log = logging.getLogger("specctl.multi")
GREEDY = SamplingParams(temperature=0.0)


class MultiDrafter(Drafter):
    name = "multi"

    def __init__(self, drafters: dict[str, Drafter], budget: int | None = None,
                 policy: RoutingPolicy | None = None) -> None:
        if not drafters:
            raise ValueError("give at least one drafter")
        trees = [name for name, d in drafters.items() if isinstance(d, ModelTreeDrafter)]
        if trees:
            raise ValueError(f"fusion takes chain drafters (model chains, n-gram); {', '.join(trees)} drafts trees")
        self.drafters = dict(drafters)
        self.names = list(drafters)
        longest = max(d.max_nodes for d in drafters.values()) - 1
        self.budget = budget if budget is not None else 2 * longest
        if self.budget < 1:
            raise ValueError(f"the fusion budget must be >= 1 node, got {self.budget}")
        self.max_nodes = 1 + self.budget
        self.policy = policy or RoutingPolicy()
        self.stats = {name: DrafterStats() for name in self.names}
        self.free = [drafters[name].free for name in self.names]

    def open(self, capacity: int, pool: KVPool | None = None) -> DraftSession:
        return _MultiSession(self, capacity, pool)

    def snapshot(self) -> dict:
        return {name: stats.snapshot() for name, stats in self.stats.items()}


class _MultiSession(DraftSession):
    def __init__(self, owner: MultiDrafter, capacity: int, pool: KVPool | None) -> None:
        self.owner = owner
        self.sessions: list[DraftSession] = []
        try:
            for name in owner.names:
                self.sessions.append(owner.drafters[name].open(capacity, pool))
        except Exception:
            self.close()
            raise
        self.scores = [RoutingScore() for _ in owner.names]
        self.asked: list[tuple[int, list[float], list[int]]] = []  # (drafter, confidences, tree nodes)
        self.rounds = 0
        self.accepted = 0

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    def propose(self, seq, params, generator):
        owner = self.owner
        scores, up = [s.value for s in self.scores], [True] * len(self.sessions)
        order = choose_drafters(scores, up, self.mean_accepted, owner.policy, uniform(generator),
                                uniform(generator), owner.free)
        chains, asked, tried = [], [], list(order)
        while order:
            for i in order:
                chain = self._ask(i, seq)
                if chain is not None:
                    chains.append(chain)
                    asked.append(i)
            # nothing proposed (no n-gram match, failures): the next-ranked drafter has a go
            following = None if any(tokens for tokens, _ in chains) else next_drafter(scores, up, tried, owner.free)
            order = [] if following is None else [following]
            tried += order
        tree, nodes = fuse_chains(seq[-1], chains, owner.budget) if chains else (TokenTree.root(seq[-1]), [])
        self.asked = [(i, chain[1][: len(path)], path) for i, chain, path in zip(asked, chains, nodes)]
        for i, confidences, _ in self.asked:
            owner.stats[owner.names[i]].chosen_rounds += bool(confidences)
            owner.stats[owner.names[i]].proposed_tokens += len(confidences)
        return Proposal(tree)

    def _ask(self, i: int, seq: list[int]) -> tuple[list[int], list[float]] | None:
        """Drafter i's chain (tokens, confidences), or None when it failed (skipped this round)."""
        name = self.owner.names[i]
        try:
            tree = self.sessions[i].propose(seq, GREEDY, None).tree
        except Exception as exc:  # noqa: BLE001 - that drafter is skipped this round
            self.owner.stats[name].failures += 1
            log.warning("drafter %s failed, skipped this round: %s", name, exc)
            self._reset(i)
            return None
        if len(tree) > 1 and tree.parents.tolist() != list(range(-1, len(tree) - 1)):
            raise ValueError(f"drafter {name} proposed a tree; fusion takes chains")
        return tree.tokens[1:].tolist(), tree.probs[1:].tolist()

    def _reset(self, i: int) -> None:
        """Back to the committed text (a draft that failed halfway may have drafted tokens)."""
        try:
            self.sessions[i].on_verified([])
        except Exception:  # noqa: BLE001 - a drafter that cannot even reset stays skipped until it can
            log.warning("drafter %s could not reset after a failure", self.owner.names[i])

    def on_verified(self, path):
        for i, confidences, nodes in self.asked:
            taken = accepted_prefix(path, nodes)
            self.sessions[i].on_verified(list(range(1, taken + 1)))
            self.scores[i].add(confidences, taken)
            self.owner.stats[self.owner.names[i]].accepted_tokens += taken
        self.asked = []
        self.rounds += 1
        self.accepted += len(path)

    def close(self) -> None:
        for i, session in enumerate(self.sessions):
            session.close()
            if i < len(getattr(self, "scores", [])) and self.scores[i].tokens:
                stats = self.owner.stats[self.owner.names[i]]
                stats.score_sum += self.scores[i].value
                stats.scored_sessions += 1
        self.sessions = []
