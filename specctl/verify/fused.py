"""Several draft servers (and the local n-gram lookup and suffix decoding) for one target
instance (CoSine): ``specctl verify --draft A --draft B [--draft ngram] [--draft suffix]``.

Per session, each round goes to the drafters ``spec.routing`` picks from their scores on
this session; the chosen ones draft at once (each its own draft server), and their
proposals (chains, or trees from a draft server in tree mode) are fused into one tree
(``spec.fusion``) verified like any tree. A drafter that is down, or
that has not answered by the deadline, is skipped for that round; its late answer is
dropped. Each draft session is told the rounds since its last proposal in one outcome (its
accepted prefix, then all the text committed since), so a drafter that sat rounds out
catches up by itself. A session routes to no drafter at all (a plain round) while its
plain rounds commit tokens faster than its speculative ones, and lets the drafter whose
rounds commit fastest for it lead (``spec.pays``). Draft servers
draft greedily (``greedy_drafts``): the fused tree is verified by the rule for
deterministic candidates, lossless at any temperature.

A proposal carries the draft's confidence in each node (its probability, a byte each): it
orders the fused tree's siblings; the n-gram lookup's count 1, suffix decoding's its own (the
share of the occurrences continuing so; one memory of outputs for all the instance's sessions)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

from specctl.spec.decode import DecodeSession
from specctl.spec.drafters import NgramDrafter, Proposal
from specctl.spec.fusion import Draft, fuse, own_path, routing_outcome
from specctl.spec.pays import PLAIN, TOP, PaysGate, arms
from specctl.spec.rounds import Drafted
from specctl.spec.routing import (NONE, DrafterStats, RoutingPolicy, RoutingScore, choose_drafters, next_drafter,
                                  rank_drafters)
from specctl.spec.stats import FALLBACK_DRAFT_DOWN
from specctl.spec.suffix import SuffixDrafter
from specctl.verify.draft_client import DraftClient
from specctl.verify.speculator import RemoteSpeculator

NGRAM = "ngram"
SUFFIX = "suffix"
# A draft server past the deadline this many rounds in a row (any sessions') sits rounds out for
# BENCH_S: asked anyway, it would hold every round it joins until the deadline for nothing.
LATE_IN_A_ROW = 3
BENCH_S = 30.0
log = logging.getLogger("specctl.verify.draft")


@dataclass(slots=True)
class Fusion:
    """What a target instance's sessions share: the draft links, the policy, the stats."""

    clients: dict[str, DraftClient]  # name (host:port) -> link; "ngram" is local and has none
    ngram_depth: int = 0  # > 0: the local n-gram lookup is one of the drafters
    suffix: SuffixDrafter | None = None  # suffix decoding, local, one of the drafters (its memory shared)
    budget: int = 16  # fused tree nodes besides the root
    deadline_s: float = 0.5  # a drafter that has not answered by then is skipped for the round
    policy: RoutingPolicy = field(default_factory=RoutingPolicy)
    stats: dict[str, DrafterStats] = field(default_factory=dict)
    pooled_rounds: dict = field(default_factory=dict)  # arm -> the last rounds the sessions measured (spec.pays)
    late_in_a_row: dict[str, int] = field(default_factory=dict)  # draft server -> its rounds past the deadline
    benched_until: dict[str, float] = field(default_factory=dict)  # draft server -> when it is asked again

    def __post_init__(self) -> None:
        for name in self.names + ([NONE] if self.policy.plain_arm else []):
            self.stats.setdefault(name, DrafterStats())
        if self.budget < 1 or self.deadline_s <= 0:
            raise ValueError("the fusion budget must be >= 1 and the deadline > 0")

    @property
    def names(self) -> list[str]:
        return [*self.clients, *([NGRAM] if self.ngram_depth else []), *([SUFFIX] if self.suffix else [])]

    def answered(self, name: str, late: bool) -> None:
        """A draft server's answer to a round, in time or past the deadline."""
        streak = self.late_in_a_row[name] = self.late_in_a_row.get(name, 0) + 1 if late else 0
        if streak >= LATE_IN_A_ROW:
            self.benched_until[name] = time.monotonic() + BENCH_S
            if streak == LATE_IN_A_ROW:  # said once; it is tried again every BENCH_S while late
                log.warning("draft server %s answered past the %g ms deadline %d rounds in a row: it sits out, tried "
                            "again every %g s (raise --draft-deadline-ms if it is merely slow)", name,
                            1e3 * self.deadline_s, streak, BENCH_S)

    def benched(self, name: str) -> bool:
        return self.benched_until.get(name, 0.0) > time.monotonic()

    def speculator(self, seed: int | None) -> "FusedSpeculator":
        return FusedSpeculator(self, seed)

    def snapshot(self) -> dict:
        out = {}
        for name in self.stats:
            client = self.clients.get(name)
            out[name] = {**self.stats[name].snapshot(),
                         "connected": True if client is None else client.connected.is_set(),
                         "benched": self.benched(name)}
        return out


@dataclass(slots=True)
class _Link:
    name: str
    remote: RemoteSpeculator | None
    score: RoutingScore = field(default_factory=RoutingScore)
    synced: int = 0  # len(session.seq) when its outstanding proposal was asked for
    path: list[int] = field(default_factory=list)  # its nodes on the verified path, the round it was last used
    outstanding: bool = False
    late: asyncio.Task | None = None  # a proposal past the deadline, still on its way


class FusedSpeculator:
    def __init__(self, fusion: Fusion, seed: int | None) -> None:
        self.fusion = fusion
        self.max_nodes = 1 + fusion.budget
        self.rng = random.Random(seed)
        self.links = [_Link(name, RemoteSpeculator(client, self.max_nodes, self.rng.getrandbits(62),
                                                   greedy_drafts=True)) for name, client in fusion.clients.items()]
        if fusion.ngram_depth:
            self.links.append(_Link(NGRAM, None))
        self.ngram = NgramDrafter(fusion.ngram_depth) if fusion.ngram_depth else None
        if fusion.suffix is not None:
            self.links.append(_Link(SUFFIX, None))
        self.suffix = fusion.suffix.open(0) if fusion.suffix is not None else None
        self.session: DecodeSession | None = None
        self.asked: list[tuple[_Link, Draft, list[int | None]]] = []  # (drafter, its draft, where it landed)
        self.rounds = self.accepted = 0
        self.gate = PaysGate(pooled=fusion.pooled_rounds if fusion.policy.pooled else None) \
            if fusion.policy.measures else None

    def begin(self, session: DecodeSession) -> None:
        self.session = session
        if session.params.repeatable:  # a seeded sample: no round chosen by measured times (the seed repeats its text)
            self.gate = None
        for link in self.links:
            if link.remote is not None:
                link.remote.begin(session)

    def _up(self, link: _Link, repeatable: bool) -> bool:
        """Whether ``link`` may draft this round. A seeded sample's rounds follow its own text
        and seed alone: no suffix decoding (its memory is every session's), no draft server
        benched by other sessions' late answers."""
        if link.name == SUFFIX:
            return not repeatable
        return link.remote is None or (link.late is None and link.remote.client is not None
                                       and link.remote.client.connected.is_set()
                                       and (repeatable or not self.fusion.benched(link.name)))

    def _score_last_round(self, session: DecodeSession, last_path: list[int]) -> None:
        if self.suffix is not None:  # every round's text, asked this round or not
            self.suffix.observe(session.seq)
        for link, draft, where in self.asked:
            link.path = own_path(last_path, where)
            link.score.add(*routing_outcome(draft, where, link.path))
            self.fusion.stats[link.name].accepted_tokens += len(link.path)
        if self.asked:
            self.rounds += 1
            self.accepted += len(last_path)
        self.asked = []

    async def propose(self, session: DecodeSession, outcome: tuple[list[int], list[int]] | None = None,
                      max_depth: int = 0) -> Drafted:
        """``outcome``: (its last proposal's accepted path, the tokens since), when rounds another
        speculator proposed in came between (each drafter is told its own catch-up anyway);
        ``max_depth``: passed to the draft servers (0: their own depth)."""
        started = time.perf_counter()
        self._score_last_round(session, session.last_path if outcome is None else outcome[0])
        stats, policy = self.fusion.stats, self.fusion.policy
        repeatable = session.params.repeatable
        scores = [link.score.value for link in self.links]
        up, free = [self._up(link, repeatable) for link in self.links], [link.remote is None for link in self.links]
        lead = TOP
        if self.gate is not None:
            if outcome is not None:  # predicted rounds came between: the time since is theirs too
                self.gate.uncounted()
            self.gate.end(len(session.last_committed), started)
            ranked = rank_drafters(scores, up, free)
            lead = self.gate.begin(arms(ranked, policy.by_rate, policy.plain_arm), started,
                                   [i for i in ranked if free[i]])
            if lead == PLAIN:
                stats[NONE].chosen_rounds += 1  # plain decoding pays more for this session now
                return Drafted(None, time.perf_counter() - started)
        mean = self.accepted / self.rounds if self.rounds else 0.0
        order = choose_drafters(scores, up, mean, policy, self.rng.random(), self.rng.random(), free,
                                None if lead == TOP else lead)
        if not order:
            return Drafted(None, time.perf_counter() - started, FALLBACK_DRAFT_DOWN)
        drafts: dict[int, Draft] = {}
        asked = list(order)
        while order:
            if self.gate is not None and any(self.links[i].remote is not None and not self.links[i].synced
                                             for i in order):
                self.gate.uncounted()  # a draft server's first draft for this session: its prompt prefill
            await self._ask(session, order, drafts, max_depth)
            # nothing proposed (no n-gram match, drafters late or failed): the next-ranked one has a go
            following = None if any(d.tokens for d in drafts.values()) else next_drafter(scores, up, asked, free)
            order = [] if following is None else [following]
            asked += order
        used = [i for i in asked if i in drafts]
        tree, placed = fuse(session.seq[-1], [drafts[i] for i in used], self.fusion.budget)
        self.asked = [(self.links[i], drafts[i], where) for i, where in zip(used, placed)]
        for link, _, where in self.asked:
            stats[link.name].fused(where)
        return Drafted(Proposal(tree), time.perf_counter() - started)

    async def _ask(self, session: DecodeSession, order: list[int], drafts: dict[int, Draft],
                   max_depth: int = 0) -> None:
        """Ask the drafters in ``order`` at once; their proposals land in ``drafts`` (a drafter
        late past the deadline or failing is skipped for this round). A seeded sample has no
        deadline (which drafters answer in time would change its text): it waits for each, up to
        the link's own timeout."""
        stats = self.fusion.stats
        deadline = None if session.params.repeatable else self.fusion.deadline_s
        tasks = {}
        for i in order:
            link = self.links[i]
            if link.remote is not None:
                outcome = (link.path if link.outstanding else [], session.seq[link.synced:])
                link.synced, link.path, link.outstanding = len(session.seq), [], False
                tasks[i] = asyncio.ensure_future(link.remote.propose(session, outcome, deadline, max_depth))
        for i in order:
            if self.links[i].name == NGRAM:
                drafts[i] = Draft.chain(tokens := self.ngram.lookup(session.seq, max_depth), [1.0] * len(tokens))
            elif self.links[i].name == SUFFIX:
                drafts[i] = Draft.of_tree(self.suffix.plain_draft(session.seq, max_depth))
        if not tasks:
            return
        try:
            done, pending = await asyncio.wait(tasks.values(), timeout=deadline)
        except asyncio.CancelledError:  # the session ended meanwhile: its proposals are nobody's
            for task in tasks.values():
                task.cancel()
            raise
        for i, task in tasks.items():
            link = self.links[i]
            if task in pending:  # skipped this round; its answer is dropped when it comes
                link.late = task
                task.add_done_callback(lambda _task, link=link: self._landed(link))
                stats[link.name].failures += 1
                self.fusion.answered(link.name, late=True)
                continue
            if deadline is not None:  # in time for a deadline (a seeded sample's answers set none)
                self.fusion.answered(link.name, late=False)
            drafted = task.result()
            proposal = drafted.proposal
            if proposal is None:
                stats[link.name].failures += drafted.fallback is not None
                continue
            link.outstanding = True
            drafts[i] = Draft.of_tree(proposal.tree)  # the draft's own confidences (protocol v4)

    @staticmethod
    def _landed(link: _Link) -> None:
        """A late proposal arrived (or failed): the draft session holds it as outstanding,
        with nothing of it accepted."""
        task, link.late = link.late, None
        if task is not None and not task.cancelled() and task.exception() is None and task.result().proposal:
            link.outstanding, link.path = True, []

    def close(self) -> None:
        if self.suffix is not None:
            if self.session is not None:
                self.suffix.observe(self.session.seq)  # the last round's tokens, which no proposal followed
            self.suffix.close()
        for link in self.links:
            if link.late is not None:
                link.late.cancel()
            if link.remote is not None:
                link.remote.close()
        for link in self.links:
            self.fusion.stats[link.name].session_ended(link.score)
