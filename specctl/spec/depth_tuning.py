"""The proposal depth a target instance's load pays for, learnt from its own rounds
(``spec_depth_by_load = "auto"``).

A fixed schedule ("3:4,6:2") holds for the machine and prompts it was measured on: where the
draft runs elsewhere a draft step costs the target nothing, on a GPU a wider batch costs almost
nothing more, and on other prompts the draft is accepted more or less often. SmartSpec chooses
each batch's proposal length by a goodput estimate; so does the instance, from its own rounds.
It holds one *arm* — a proposal depth (0: the drafter's own, then at most 4, at most 2) or
plain rounds — for an *epoch* of EPOCH_ROUNDS measured rounds a session, and keeps each arm's
mean round time and drafted depth at each load. An arm's rate is the tokens a round of it
commits, expected from the acceptance of every recent speculative round (any arm, any load:
what the draft guesses right does not depend on the load), over its round time: the committed
tokens of an epoch vary with the text far more than its times do (a rate measured by epochs'
tokens swung 5.6-10.5 tokens/s for one arm at one load, bench serve at 4 clients), and one
acceptance for all arms compares them on the same text. The acceptance at each position is the
share of the rounds that reached it and accepted it (``acceptance``): one geometric rate fitted
to all rounds overrated the caps (0.9 a token, where chains capped at 4 accepted 2.3 of 4). At
one load the rate is proportional to the instance's tokens per second. At each load
(the most sessions it ran in the last LOAD_HOLD_S, so that a client's gap between two requests
is not a new load) it takes the fastest arm (``spec.pays.next_arm``, by epochs: the first arm
twice, then each other it has no rate for, then the fastest and now and then the runner-up
again); once two depths are measured at a load, the others are rated by a round time fitted
to them (``predicted``), so it tries the arms the fit does not rule out. A session's first round of an epoch is not
measured: it was batched with rounds of the last arm, and after plain rounds its draft
catches up on them. A load met for the first time starts on the arm the nearest load already
measured found fastest. Every arm is lossless: slower or faster, never different."""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import Callable, NamedTuple

from specctl.spec.pays import PLAIN, WINDOW, next_arm, rate
from specctl.spec.turns import LOAD_HOLD_S

log = logging.getLogger("specctl.verify.depth")
LADDER = (0, 4, 2)  # proposal depths tried (0: the drafter's own), then plain rounds
EPOCH_ROUNDS = 3  # measured rounds a session per epoch
ACCEPTANCE_ROUNDS = 256  # the recent speculative rounds the acceptance rate is taken over


def acceptance(rounds) -> list[float]:
    """Of (accepted, drafted) rounds, the share accepted at each position i = 1, 2, ... of the
    rounds that reached it: drafted at least i tokens and accepted the i - 1 before (a round
    that drafted fewer says nothing of position i)."""
    reached = [0] * (max((d for _, d in rounds), default=0) + 1)
    passed = list(reached)
    for accepted, drafted in rounds:
        for i in range(1, min(accepted + 1, drafted) + 1):
            reached[i] += 1
            passed[i] += i <= accepted
    return [passed[i] / reached[i] for i in range(1, len(reached)) if reached[i]]


def expected_tokens(by_position: list[float], depth: float) -> float:
    """Tokens a round of a chain ``depth`` deep commits (the bonus included), by the acceptance
    at each position (past the last known one, its rate again; a fractional depth: a share of
    the next position's)."""
    tokens, reach = 1.0, 1.0
    for i in range(1, int(depth) + 2):
        share = min(depth - (i - 1), 1.0)
        if share <= 0:
            break
        reach *= by_position[min(i, len(by_position)) - 1] if by_position else 0.0
        tokens += share * reach
    return tokens


def mean_round(epochs) -> tuple[float, float]:
    """(drafted depth, seconds) of a mean round over (rounds, seconds, drafted) epochs."""
    rounds = sum(r for r, _, _ in epochs)
    return sum(d for _, _, d in epochs) / rounds, sum(s for _, s, _ in epochs) / rounds


class Ticket(NamedTuple):
    """A round's place in the tuner's epochs: measured unless it is its session's first of the epoch."""

    epoch: int
    measured: bool


def arm_name(arm: int) -> str:
    return "plain" if arm == PLAIN else "own" if arm == 0 else str(arm)


class PeakLoad:
    """The most sessions an instance ran in about the last ``hold_s`` (a dip shorter than that,
    a client's gap between requests, keeps the load it interrupts)."""

    def __init__(self, hold_s: float = LOAD_HOLD_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s, self.clock = hold_s, clock
        self.peak, self.until = 0, float("-inf")

    def __call__(self, active: int) -> int:
        now = self.clock()
        if active >= self.peak or now >= self.until:
            self.peak, self.until = active, now + self.hold_s
        return self.peak


class DepthTuner:
    """One per target instance, asked by every session's round (spec.turns.SpeculationByLoad)."""

    def __init__(self, load: Callable[[], int], clock: Callable[[], float] = time.monotonic,
                 hold_s: float = LOAD_HOLD_S) -> None:
        """``load``: the sessions the instance runs now. (The draft's own depth is not known
        here — a draft server elsewhere chose it — so a cap at or above it is tried too: one
        wasted epoch or so a load.)"""
        self.load = load
        self.arms = [*LADDER, PLAIN]
        self.peak = PeakLoad(hold_s, clock)
        # load -> arm -> its last WINDOW epochs (rounds, seconds, drafted tokens)
        self.measured: dict[int, dict[int, deque]] = {}
        self.accepted: deque = deque(maxlen=ACCEPTANCE_ROUNDS)  # (accepted, drafted) of speculative rounds
        self.level: int | None = None  # the load of the epoch in progress
        self.arm, self.streak, self.epoch = self.arms[0], 0, 0
        self.rounds, self.seconds, self.drafted = 0, 0.0, 0  # the epoch's measured rounds

    def plan(self, last: Ticket | None) -> tuple[int | None, Ticket]:
        """A session's next round: None for a plain round, else its deepest proposal (0: the
        drafter's own), and its ticket; ``last``: the session's previous round's ticket."""
        level = self.peak(self.load())
        if level != self.level:
            self._end_epoch(keep=self.level is not None and self.rounds >= self.level)
            self.level, self.streak = level, 0
            self._next_arm()
        elif self.rounds >= EPOCH_ROUNDS * max(level, 1):
            self._end_epoch(keep=True)
            self._next_arm()
        measured = last is not None and last.epoch == self.epoch
        return (None if self.arm == PLAIN else self.arm), Ticket(self.epoch, measured)

    def ended(self, ticket: Ticket, seconds: float, drafted: int, accepted: int) -> None:
        """The round of ``ticket`` took ``seconds`` (from asking for its proposal to asking for
        the next) and accepted ``accepted`` of the ``drafted`` tokens deep proposal."""
        if drafted > 0:
            self.accepted.append((accepted, drafted))
        if ticket.measured and ticket.epoch == self.epoch:
            self.rounds, self.seconds, self.drafted = self.rounds + 1, self.seconds + seconds, self.drafted + drafted

    def _end_epoch(self, keep: bool) -> None:
        if keep and self.seconds > 0:
            arms = self.measured.setdefault(self.level, {})
            arms.setdefault(self.arm, deque(maxlen=WINDOW)).append((self.rounds, self.seconds, self.drafted))
            log.debug("load %d, depth %s: %.0f ms a round, %.1f drafted", self.level, arm_name(self.arm),
                      1000 * self.seconds / self.rounds, self.drafted / self.rounds)
        self.rounds, self.seconds, self.drafted = 0, 0.0, 0
        self.epoch += 1

    def rated(self, level: int) -> dict[int, list[tuple[float, float]]]:
        """Each arm measured at ``level``: its epochs as (expected tokens, seconds) of its mean
        round, as many as it has epochs (``next_arm`` reads their count)."""
        by_position = acceptance(self.accepted)
        rated = {}
        for arm, epochs in self.measured.get(level, {}).items():
            depth, seconds = mean_round(epochs)
            rated[arm] = [(expected_tokens(by_position, depth) if arm != PLAIN else 1.0, seconds)] * len(epochs)
        return rated

    def predicted(self, level: int) -> dict[int, list[tuple[float, float]]]:
        """The arms not measured at ``level``, rated by a round time fitted to those that are:
        linear in the drafted depth (a draft step and a verified row a token: SmartSpec's cost
        model), once two depths are measured there. So a load tries the arms the fit does not
        rule out (``next_arm`` probes the runner-up), not every arm. A cap drafts as deep as
        the drafter drafted under no cap, at any load, where that is shallower."""
        points = [mean_round(epochs) for epochs in self.measured.get(level, {}).values()]
        if len({depth for depth, _ in points}) < 2:
            return {}
        slope, intercept = statistics.linear_regression([d for d, _ in points], [s for _, s in points])
        if slope <= 0 or intercept <= 0:  # noise: no fit to trust
            return {}
        own = [epoch for arms in self.measured.values() for epoch in arms.get(0, ())]
        own_depth = mean_round(own)[0] if own else None
        by_position, predicted = acceptance(self.accepted), {}
        for arm in self.arms:
            if arm in self.measured.get(level, {}) or (arm == 0 and own_depth is None):
                continue
            depth = 0.0 if arm == PLAIN else own_depth if arm == 0 else min(arm, own_depth or arm)
            tokens = 1.0 if arm == PLAIN else expected_tokens(by_position, depth)
            predicted[arm] = [(tokens, intercept + slope * depth)]
        return predicted

    def _next_arm(self) -> None:
        measured = self.rated(self.level)
        arm = next_arm(measured, self.order(self.level), self.arm if self.streak else None, self.streak,
                       self.predicted(self.level))
        self.streak = self.streak + 1 if arm == self.arm else 1
        self.arm = arm

    def order(self, level: int) -> list[int]:
        """The arms best first, as the nearest load measured so far rates them (the ladder's
        order before any; a load's own rates take over once it has them, in ``next_arm``)."""
        known = [other for other, arms in self.measured.items() if arms and other != level]
        if level in self.measured or not known:
            return list(self.arms)
        nearest = self.rated(min(known, key=lambda other: (abs(other - level), other)))
        return sorted(self.arms, key=lambda arm: (arm not in nearest, -rate(nearest.get(arm, ()))))

    def snapshot(self) -> dict:
        """The stats feed's: the arm now, its load, and each arm's rate at that load (expected
        tokens a second a session)."""
        rates = {arm_name(arm): round(rate(epochs), 3) for arm, epochs in self.rated(self.level).items()}
        return {"spec_depth_now": arm_name(self.arm), "spec_depth_cap": self.arm, "spec_depth_load": self.level or 0,
                "spec_depth_rates": rates, "spec_depth_epochs": self.epoch,
                "spec_depth_acceptance": [round(rate, 3) for rate in acceptance(self.accepted)]}
