"""The proposal depth a target instance's load pays for, learnt from its own rounds
(``spec_depth_by_load = "auto"``).

A fixed schedule ("3:4,6:2") holds for the machine and prompts it was measured on: where the
draft runs elsewhere a draft step costs the target nothing, on a GPU a wider batch costs almost
nothing more, and on other prompts the draft is accepted more or less often. SmartSpec chooses
each batch's proposal length by a goodput estimate; here the instance measures it instead. It
holds one *arm* — a proposal depth (0: the drafter's own, then at most 4, at most 2) or plain
rounds — for an *epoch* of EPOCH_ROUNDS measured rounds a session, and rates the arm by its
sessions' committed tokens per second of round time (at one load, proportional to the
instance's tokens per second). At each load (the most sessions it ran in the last
LOAD_HOLD_S, so that a client's gap between two requests is not a new load) it takes the
fastest arm after trying each, and now and then the runner-up again (``spec.pays.next_arm``,
by epochs: the first arm twice, every other once). A session's first round of an epoch is not
measured: it was batched with rounds of the last arm, and after plain rounds its draft
catches up on them. A load met for the first time starts on the arm the nearest load already
measured found fastest. Every arm is lossless: slower or faster, never different."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, NamedTuple

from specctl.spec.pays import PLAIN, WINDOW, next_arm, rate
from specctl.spec.turns import LOAD_HOLD_S

LADDER = (0, 4, 2)  # proposal depths tried (0: the drafter's own), then plain rounds
EPOCH_ROUNDS = 3  # measured rounds a session per epoch


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
        self.measured: dict[int, dict[int, deque]] = {}  # load -> arm -> its last WINDOW epochs (tokens, seconds)
        self.level: int | None = None  # the load of the epoch in progress
        self.arm, self.streak, self.epoch = self.arms[0], 0, 0
        self.tokens, self.seconds, self.rounds = 0, 0.0, 0  # the epoch's measured rounds

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

    def ended(self, ticket: Ticket, tokens: int, seconds: float) -> None:
        """The round of ``ticket`` committed ``tokens`` in ``seconds`` (from asking for its
        proposal to asking for the next)."""
        if ticket.measured and ticket.epoch == self.epoch:
            self.tokens, self.seconds, self.rounds = self.tokens + tokens, self.seconds + seconds, self.rounds + 1

    def _end_epoch(self, keep: bool) -> None:
        if keep and self.seconds > 0:
            arms = self.measured.setdefault(self.level, {})
            arms.setdefault(self.arm, deque(maxlen=WINDOW)).append((self.tokens, self.seconds))
        self.tokens, self.seconds, self.rounds = 0, 0.0, 0
        self.epoch += 1

    def _next_arm(self) -> None:
        measured = self.measured.get(self.level, {})
        arm = next_arm(measured, self.order(self.level), self.arm if self.streak else None, self.streak)
        self.streak = self.streak + 1 if arm == self.arm else 1
        self.arm = arm

    def order(self, level: int) -> list[int]:
        """The arms best first, as the nearest load measured so far rates them (the ladder's
        order before any; a load's own rates take over once it has them, in ``next_arm``)."""
        known = [other for other, arms in self.measured.items() if arms and other != level]
        if level in self.measured or not known:
            return list(self.arms)
        nearest = self.measured[min(known, key=lambda other: (abs(other - level), other))]
        return sorted(self.arms, key=lambda arm: (arm not in nearest, -rate(nearest.get(arm, ()))))

    def snapshot(self) -> dict:
        """The stats feed's: the arm now, its load, and each arm's rate at that load."""
        rates = {arm_name(arm): round(rate(epochs), 3) for arm, epochs in self.measured.get(self.level, {}).items()}
        return {"spec_depth_now": arm_name(self.arm), "spec_depth_cap": self.arm, "spec_depth_load": self.level or 0,
                "spec_depth_rates": rates, "spec_depth_epochs": self.epoch}
