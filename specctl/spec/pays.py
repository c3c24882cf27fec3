"""Whether speculating pays for one session, measured on the session's own rounds.

Speculation loses where the drafters guess badly (a code drafter on prose): a round costs
the drafting plus the verification of every proposed node and commits barely more than the
one token of a plain decoding step. So routing has one arm besides the drafters: *none*, a
round that verifies the root alone (plain decoding: lossless like every round). Each
session keeps the committed tokens per second of its last WINDOW measured rounds of either
arm (a round's time: from asking for its proposal to its verified outcome) and takes the
faster arm; after PROBE_EVERY rounds in a row on one arm it tries the other once, as the
text may have changed (prose, then code).

The first speculative round after plain ones is not measured: the drafters catch up on the
text committed meanwhile (the first round of a session: the draft's prompt prefill), which
a steady round does not pay. A probe of speculation therefore lasts until one round of it
was measured. Vanilla CoSine has no such arm; vLLM and SGLang users know it as dynamic
speculation (turned off where it does not pay)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW = 8  # measured rounds per arm the rates are taken over
PROBE_EVERY = 16  # rounds in a row on one arm before the other is tried once
SPEC_FIRST = 2  # measured speculative rounds before the first plain round is tried

Round = tuple[int, float]  # (tokens committed, seconds)


def rate(rounds: "deque[Round] | list[Round]") -> float:
    """Committed tokens per second over the rounds (0 when no time was measured)."""
    seconds = sum(s for _, s in rounds)
    return sum(t for t, _ in rounds) / seconds if seconds > 0 else 0.0


def speculate_next(spec: list[Round], plain: list[Round], current: bool | None, streak: int) -> bool:
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
    catching_up: bool = False  # the round in flight is the drafters' catch-up: not measured
    probe_pending: bool = False  # a catch-up round ended: speculate once more, measured
    plain_rounds: int = 0

    def begin(self, now: float) -> bool:
        """A round starts: speculate in it?"""
        arm = True if self.probe_pending else speculate_next(list(self.spec), list(self.plain), self.current,
                                                             self.streak)
        self.catching_up = arm and self.current is not True
        self.streak = self.streak + 1 if arm == self.current else 1
        self.current, self.started = arm, now
        self.plain_rounds += not arm
        return arm

    def end(self, tokens: int, now: float) -> None:
        """The round in flight committed ``tokens``."""
        if self.started is None:
            return
        if not self.catching_up:
            (self.spec if self.current else self.plain).append((tokens, now - self.started))
        self.probe_pending, self.started = self.catching_up, None
