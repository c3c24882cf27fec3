"""Whether speculating pays for one session, measured on the session's own rounds.

Speculation loses where the drafters guess badly (a code drafter on prose): a round costs
the drafting plus the verification of every proposed node and commits barely more than the
one token of a plain decoding step. So routing has one arm besides the drafters: *none*, a
round that verifies the root alone (plain decoding: lossless like every round). Each
session keeps the committed tokens per second of its last WINDOW measured rounds of either
arm (a round's time: from asking for its proposal to its verified outcome) and takes the
faster arm; after PROBE_EVERY rounds in a row on one arm it tries the other once, as the
text may have changed (prose, then code).

A session's first speculative round is not measured: it holds the draft's prompt prefill,
which no later round pays. Vanilla CoSine has no such arm; vLLM and SGLang users know it as dynamic
speculation (turned off where it does not pay)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

WINDOW = 8  # measured rounds per arm the rates are taken over
PROBE_EVERY = 16  # rounds in a row on one arm before the other is tried once
SPEC_FIRST = 2  # measured speculative rounds before the first plain round is tried

Round = tuple[int, float]  # (tokens committed, seconds)


def rate(rounds: Sequence[Round]) -> float:
    """Committed tokens per second over the rounds (0 when no time was measured)."""
    seconds = sum(s for _, s in rounds)
    return sum(t for t, _ in rounds) / seconds if seconds > 0 else 0.0


def speculate_next(spec: Sequence[Round], plain: Sequence[Round], current: bool | None, streak: int) -> bool:
    """Speculate in the next round? (pure) ``spec``/``plain``: each arm's measured rounds;
    ``current``: the arm of the last round (None before the first); ``streak``: how many
    rounds in a row it was taken."""
    if len(spec) < SPEC_FIRST:
        return True
    if not plain:
        return False
    faster = rate(spec) >= rate(plain)
    if current == faster and streak >= PROBE_EVERY:
        return not faster
    return faster


@dataclass(slots=True)
class PaysGate:
    """One session's choice between speculating and plain rounds (``speculate_next``)."""

    spec: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    plain: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    current: bool | None = None  # the arm of the round in flight (or of the last one)
    streak: int = 0  # rounds in a row on that arm
    started: float | None = None  # when the round in flight was asked for; None: none in flight
    first: bool = False  # the round in flight is the session's first (the draft's prompt prefill): not measured

    def begin(self, now: float) -> bool:
        """A round starts: speculate in it?"""
        arm = speculate_next(self.spec, self.plain, self.current, self.streak)
        self.first = self.current is None
        self.streak = self.streak + 1 if arm == self.current else 1
        self.current, self.started = arm, now
        return arm

    def end(self, tokens: int, now: float) -> None:
        """The round in flight committed ``tokens``."""
        if self.started is None:
            return
        if not self.first:
            (self.spec if self.current else self.plain).append((tokens, now - self.started))
        self.started = None
