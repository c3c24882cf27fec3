"""Routing among several drafters (CoSine, DESIGN §4), as pure functions.

Per session and drafter a routing score m = (1/K) Σ c·d / (c·d + (1−c)(1−d)) over the K
tokens the drafter proposed so far, from its confidence c (its own probability of the
token) and the verification outcome d (1 accepted, 0 not). While the session's mean
accepted length is under τ the router explores: the top-scored drafter, plus another one at
random with probability α; above τ it exploits: the top one, plus a random other with
probability β < α. A drafter that is down is not a candidate.

Beyond CoSine, cost: a *free* drafter (the local n-gram lookup: no model, no network) wins
ties, so it is tried before a model drafter nothing is known about yet, and with
``free_riders`` it joins every round's fusion at no drafting cost. A round whose chosen
drafters propose nothing asks the next-ranked one (``next_drafter``), so an n-gram lookup
that finds no match never leaves a round without a proposal. And a session may route to
no drafter at all (``plain_arm``), and let the drafter whose rounds commit tokens fastest
for it lead (``by_rate``): the score does not see what a round costs (``spec.pays``)."""

from __future__ import annotations

from dataclasses import dataclass

PRIOR = 0.5  # the score of a drafter nothing is known about yet
NONE = "none"  # the stats' name for the rounds routed to no drafter (plain decoding)


def token_score(confidence: float, outcome: float) -> float:
    """c·d / (c·d + (1−c)(1−d)); 0 where both terms vanish (c = 1 and d = 0)."""
    agree = confidence * outcome
    denominator = agree + (1.0 - confidence) * (1.0 - outcome)
    return 0.0 if denominator <= 0.0 else agree / denominator


@dataclass(slots=True)
class RoutingScore:
    """A drafter's running score within one session."""

    total: float = 0.0
    tokens: int = 0

    def add(self, confidences: list[float], accepted: int) -> None:
        """One round's proposal of this drafter: its tokens' confidences, and how many of
        them (a prefix) verification accepted."""
        for i, confidence in enumerate(confidences):
            self.total += token_score(confidence, 1.0 if i < accepted else 0.0)
        self.tokens += len(confidences)

    @property
    def value(self) -> float:
        return self.total / self.tokens if self.tokens else PRIOR


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    tau: float = 2.0  # mean accepted length under which the router explores
    alpha: float = 0.5  # chance of adding a random other drafter while exploring
    beta: float = 0.1  # ... while exploiting
    free_riders: bool = True  # free drafters join every round (fusion); False: one drafter a round
    plain_arm: bool = True  # a session may route to no drafter where plain rounds commit faster (spec.pays)
    by_rate: bool = True  # the drafter whose rounds commit fastest for the session leads (spec.pays); False: the top score
    pooled: bool = True  # a session starts from the rates the target's other sessions measured (spec.pays)

    @property
    def measures(self) -> bool:
        """Whether sessions measure their rounds (spec.pays)."""
        return self.plain_arm or self.by_rate

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta <= self.alpha <= 1.0:
            raise ValueError(f"need 0 <= beta <= alpha <= 1, got alpha={self.alpha}, beta={self.beta}")
        if self.tau < 0:
            raise ValueError(f"tau must be >= 0, got {self.tau}")


def rank_drafters(scores: list[float], up: list[bool], free: list[bool] | None = None) -> list[int]:
    """The drafters that are up, best first: by score, then free before costly, then in order."""
    free = free or [False] * len(scores)
    return sorted((i for i, ok in enumerate(up) if ok), key=lambda i: (-scores[i], not free[i], i))


def choose_drafters(scores: list[float], up: list[bool], mean_accepted: float, policy: RoutingPolicy,
                    coin: float, pick: float, free: list[bool] | None = None, lead: int | None = None) -> list[int]:
    """The drafters to ask this round (indices, the leader first — ``lead`` if it is up, else
    the top-ranked —, then a random other one, then the free riders). ``coin`` and ``pick``
    are uniforms in [0, 1): whether to add a random other drafter, and which one."""
    ranked = rank_drafters(scores, up, free)
    if not ranked:
        return []
    top = lead if lead in ranked else ranked[0]
    others = sorted(i for i in ranked if i != top)
    chance = policy.alpha if mean_accepted < policy.tau else policy.beta
    chosen = [top]
    if others and coin < chance:
        chosen.append(others[min(int(pick * len(others)), len(others) - 1)])
    if policy.free_riders and free:
        chosen += [i for i in ranked if free[i] and i not in chosen]
    return chosen


def next_drafter(scores: list[float], up: list[bool], asked: list[int], free: list[bool] | None = None) -> int | None:
    """The best-ranked drafter not asked yet this round (None when none is left)."""
    return next((i for i in rank_drafters(scores, up, free) if i not in asked), None)


@dataclass(slots=True)
class DrafterStats:
    """What one drafter did, over all sessions (stats, /metrics, the monitor)."""

    chosen_rounds: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    failures: int = 0
    score_sum: float = 0.0
    scored_sessions: int = 0

    def fused(self, where: list[int | None]) -> None:
        """Its draft went into a round's fused tree (``where``: each of its nodes' place, None if cut)."""
        kept = sum(node is not None for node in where)
        self.chosen_rounds += bool(kept)
        self.proposed_tokens += kept

    def session_ended(self, score: "RoutingScore") -> None:
        """A session that used it ended: its routing score joins the mean."""
        if score.tokens:
            self.score_sum += score.value
            self.scored_sessions += 1

    def snapshot(self) -> dict:
        return {"chosen_rounds": self.chosen_rounds, "proposed_tokens": self.proposed_tokens,
                "accepted_tokens": self.accepted_tokens, "failures": self.failures,
                "mean_score": round(self.score_sum / self.scored_sessions, 4) if self.scored_sessions else None}
