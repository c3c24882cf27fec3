"""Several drafters for one target (CoSine): a Drafter whose sessions route each round to
the drafters that do best on this session (``spec.routing``) and fuse their proposals
(chains or trees) into one tree (``spec.fusion``). A drafter that fails is skipped for
that round (its failure is counted); if all fail the round verifies the root alone, as it
does by choice where the session's plain rounds commit faster (``spec.pays``). Lossless like
every tree: greedy output is the target's, and sampled requests get deterministic
candidates (each drafter drafts greedily) verified by recursive rejection, so no q is ever
passed that was not sampled from."""

from __future__ import annotations

import logging
import time
from typing import Callable

from specctl.engine.kv_cache import KVPool
from specctl.engine.tree import TokenTree
from specctl.spec.drafters import DraftSession, Drafter, Proposal
from specctl.spec.fusion import Draft, fuse, own_path, routing_outcome
from specctl.spec.pays import PLAIN, TOP, PaysGate, arms
from specctl.spec.routing import (NONE, DrafterStats, RoutingPolicy, RoutingScore, choose_drafters, next_drafter,
                                  rank_drafters)
from specctl.spec.params import SamplingParams
from specctl.spec.sampling import uniform

log = logging.getLogger("specctl.multi")
GREEDY = SamplingParams(temperature=0.0)


class MultiDrafter(Drafter):
    name = "multi"

    def __init__(self, drafters: dict[str, Drafter], budget: int | None = None,
                 policy: RoutingPolicy | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        if not drafters:
            raise ValueError("give at least one drafter")
        self.drafters = dict(drafters)
        self.names = list(drafters)
        longest = max(d.max_nodes for d in drafters.values()) - 1
        self.budget = budget if budget is not None else 2 * longest
        if self.budget < 1:
            raise ValueError(f"the fusion budget must be >= 1 node, got {self.budget}")
        self.max_nodes = 1 + self.budget
        self.policy = policy or RoutingPolicy()
        self.stats = {name: DrafterStats() for name in self.names}
        self.plain = DrafterStats()  # the rounds routed to no drafter
        self.pooled_rounds: dict = {}  # arm -> the last rounds its sessions measured (spec.pays)
        self.clock = clock
        self.free = [drafters[name].free for name in self.names]

    def open(self, capacity: int, pool: KVPool | None = None) -> DraftSession:
        return _MultiSession(self, capacity, pool)

    def snapshot(self) -> dict:
        drafters = {name: stats.snapshot() for name, stats in self.stats.items()}
        return drafters | ({NONE: self.plain.snapshot()} if self.policy.plain_arm else {})


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
        self.asked: list[tuple[int, Draft, list[int | None]]] = []  # (drafter, its draft, where it landed)
        self.rounds = 0
        self.accepted = 0
        self.gate = PaysGate(pooled=owner.pooled_rounds if owner.policy.pooled else None) \
            if owner.policy.measures else None
        self.drafted: set[int] = set()  # the drafters that have drafted in this session (their prompt prefill done)

    @property
    def depth_cap(self) -> int:
        """Its drafters' cap (0: their own depths), as the target's load asks: fusing their
        drafts never makes a tree deeper than the deepest of them."""
        return next((s.depth_cap for s in self.sessions if hasattr(s, "depth_cap")), 0)

    @depth_cap.setter
    def depth_cap(self, levels: int) -> None:
        for session in self.sessions:
            if hasattr(session, "depth_cap"):
                session.depth_cap = levels

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    def observe(self, seq: list[int]) -> None:
        for session in self.sessions:
            session.observe(seq)

    def propose(self, seq, params, generator):
        owner, policy = self.owner, self.owner.policy
        if params.repeatable:  # a seeded sample: no round chosen by measured times, so the seed repeats its text
            self.gate = None
        self.observe(seq)  # a drafter not asked this round (suffix decoding) still learns the text
        scores, up = [s.value for s in self.scores], [True] * len(self.sessions)
        lead = TOP
        if self.gate is not None:
            ranked = rank_drafters(scores, up, owner.free)
            lead = self.gate.begin(arms(ranked, policy.by_rate, policy.plain_arm), owner.clock(),
                                   [i for i in ranked if owner.free[i]])
            if lead == PLAIN:
                owner.plain.chosen_rounds += 1
                self.asked = []
                return Proposal(TokenTree.root(seq[-1]))  # plain decoding pays more for this session now
        order = choose_drafters(scores, up, self.mean_accepted, policy, uniform(generator), uniform(generator),
                                owner.free, None if lead == TOP else lead)
        drafts, asked, tried = [], [], list(order)
        while order:
            for i in order:
                draft = self._ask(i, seq)
                if draft is not None:
                    drafts.append(draft)
                    asked.append(i)
            # nothing proposed (no n-gram match, failures): the next-ranked drafter has a go
            following = None if any(d.tokens for d in drafts) else next_drafter(scores, up, tried, owner.free)
            order = [] if following is None else [following]
            tried += order
        if self.gate is not None and any(not owner.free[i] and i not in self.drafted for i in tried):
            self.gate.uncounted()  # a model drafter's first draft here: its prompt prefill is in this round
        self.drafted.update(tried)
        plain, placed = fuse(seq[-1], drafts, owner.budget) if drafts else (None, [])
        tree = plain.built() if plain is not None else TokenTree.root(seq[-1])  # on the compute thread
        self.asked = list(zip(asked, drafts, placed))
        for i, _, where in self.asked:
            owner.stats[owner.names[i]].fused(where)
        return Proposal(tree)

    def _ask(self, i: int, seq: list[int]) -> Draft | None:
        """Drafter i's proposal (a chain or a tree), or None when it failed (skipped this round)."""
        name = self.owner.names[i]
        try:
            return Draft.of_tree(self.sessions[i].propose(seq, GREEDY, None).tree)
        except Exception as exc:  # noqa: BLE001 - that drafter is skipped this round
            self.owner.stats[name].failures += 1
            log.warning("drafter %s failed, skipped this round: %s", name, exc)
            self._reset(i)
            return None

    def _reset(self, i: int) -> None:
        """Back to the committed text (a draft that failed halfway may have drafted tokens)."""
        try:
            self.sessions[i].on_verified([])
        except Exception:  # noqa: BLE001 - a drafter that cannot even reset stays skipped until it can
            log.warning("drafter %s could not reset after a failure", self.owner.names[i])

    def rounds_between(self) -> None:
        if self.gate is not None:
            self.gate.uncounted()  # the time since this round was asked for is the predicted rounds' too

    def on_verified(self, path):
        if self.gate is not None:
            self.gate.end(len(path) + 1, self.owner.clock())
            if self.gate.plain:
                return  # a plain round: no drafter to tell, no routing evidence
        for i, draft, where in self.asked:
            taken = own_path(path, where)
            self.sessions[i].on_verified(taken)
            self.scores[i].add(*routing_outcome(draft, where, taken))
            self.owner.stats[self.owner.names[i]].accepted_tokens += len(taken)
        self.asked = []
        self.rounds += 1
        self.accepted += len(path)

    def close(self) -> None:
        for i, session in enumerate(self.sessions):
            session.close()
            if i < len(getattr(self, "scores", [])):
                self.owner.stats[self.owner.names[i]].session_ended(self.scores[i])
        self.sessions = []
