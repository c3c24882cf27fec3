"""Whether pre-speculation pays, measured rather than predicted: SSD's model knows the hit
rate and the draft time it hides, but not what pre-speculating costs the rest of the
machine — a request waiting for a background step, or a target whose verification slows
while the draft computes beside it on shared cores (measured: 30-40 % on a 2-core box,
where SSD predicted a 10 % gain and the star lost 10-20 %).

So the draft server runs trials: TRIAL_ROUNDS rounds with pre-speculation, as many
without, then keeps whichever gave its sessions more committed tokens per second of round
time (the time between two outcomes of a session) for KEEP_ROUNDS rounds, and tries
again. Rounds count over all sessions; a session's round counts for the mode its proposal
was made in.

What pays at one session (the draft idles while its target verifies) need not at three (it
hardly idles, and its background steps make the other targets' requests wait), so each load
level — the sessions pre-speculation knows of, bucketed 1, 2, 3-4, 5-8, ... — has a trial
and a decision of its own: a draft server whose load changes does not keep the decision it
measured at another load for KEEP_ROUNDS rounds."""

from __future__ import annotations

from dataclasses import dataclass, field

TRIAL_ROUNDS = 24
KEEP_ROUNDS = 512


def keep_prespec(on_tokens: int, on_seconds: float, off_tokens: int, off_seconds: float) -> bool:
    """Pre-speculation stays on unless rounds without it committed tokens faster (pure)."""
    if on_seconds <= 0 or off_seconds <= 0:
        return True
    return on_tokens / on_seconds >= off_tokens / off_seconds


@dataclass(slots=True)
class Trial:
    phase: str = "on"  # "on" | "off": measuring that mode; "keep": using the winner
    left: int = TRIAL_ROUNDS
    kept: bool = True
    tokens: dict = field(default_factory=lambda: {True: 0, False: 0})
    seconds: dict = field(default_factory=lambda: {True: 0.0, False: 0.0})
    decisions: int = 0

    def next_round(self) -> bool:
        """Pre-speculate the round now being proposed?"""
        if self.left <= 0:
            self._advance()
        self.left -= 1
        return self.kept if self.phase == "keep" else self.phase == "on"

    def record(self, prespeculated: bool, tokens: int, seconds: float) -> None:
        """A session's round ended: ``tokens`` committed in ``seconds`` since its last outcome."""
        if self.phase != "keep":
            self.tokens[prespeculated] += tokens
            self.seconds[prespeculated] += seconds

    def _advance(self) -> None:
        if self.phase == "on":
            self.phase, self.left = "off", TRIAL_ROUNDS
        elif self.phase == "off":
            self.kept = keep_prespec(self.tokens[True], self.seconds[True], self.tokens[False], self.seconds[False])
            self.phase, self.left, self.decisions = "keep", KEEP_ROUNDS, self.decisions + 1
        else:
            self.phase, self.left = "on", TRIAL_ROUNDS
            self.tokens, self.seconds = {True: 0, False: 0}, {True: 0.0, False: 0.0}

    def snapshot(self) -> dict:
        rate = lambda on: round(self.tokens[on] / self.seconds[on], 3) if self.seconds[on] else 0.0  # noqa: E731
        return {"phase": self.phase, "kept": self.kept, "tokens_per_s_on": rate(True), "tokens_per_s_off": rate(False),
                "decisions": self.decisions}


def load_level(sessions: int) -> int:
    """The load bucket a decision holds for, named by its largest session count: 1, 2, 4, 8, ..."""
    return 1 << max(sessions - 1, 0).bit_length()


@dataclass(slots=True)
class Trials:
    """A Trial per load level."""
    by_level: dict[int, Trial] = field(default_factory=dict)

    def next_round(self, sessions: int) -> tuple[bool, int]:
        """Pre-speculate the round now being proposed with ``sessions`` sessions about, and the
        level it counts for."""
        level = load_level(sessions)
        return self.by_level.setdefault(level, Trial()).next_round(), level

    def record(self, level: int, prespeculated: bool, tokens: int, seconds: float) -> None:
        trial = self.by_level.get(level)
        if trial is not None:
            trial.record(prespeculated, tokens, seconds)

    def snapshot(self) -> dict:
        return {str(level): trial.snapshot() for level, trial in sorted(self.by_level.items())}
