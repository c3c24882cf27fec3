"""Which arm pays for one session, measured on the session's own rounds.

CoSine's routing score is the share of a drafter's tokens that were accepted; it does not see
what a round costs. Speculation loses where the drafters guess badly (a code drafter on prose):
a round costs the drafting plus the verification of every proposed node and commits barely
more than the one token of a plain decoding step. And a free drafter (the n-gram lookup) whose
matches are accepted half the time may score as well as a model drafter whose rounds commit
twice the tokens. So each session measures its *arms* — a drafter leading the round (it drafts
first; the others join as routing says), or *none*: a round that verifies the root alone
(plain decoding, lossless like every round) — by the committed tokens per second of their last
WINDOW measured rounds (a round's time: from asking for its proposal to its verified outcome),
and takes the fastest. Before that it tries them: the best-ranked arm SPEC_FIRST times, every
other once, in the routing score's order. Then, after some rounds in a row on the fastest, it
tries the runner-up once, as the text may have changed (prose, then code) and a rate from few
rounds is a guess: after 2 rounds while the runner-up has 1 measured, growing to PROBE_EVERY
once it has a full window (``probe_after``).

A target's sessions share what they measured (``pooled``: each arm's last WINDOW measured
rounds over all of them): a session judges an arm by its own rounds once it has any, and by
the pooled ones until then, so a new session starts on the arm the target found fastest and
does not pay again for trying every arm — the costly drafter that never pays on this target
is not tried by each session anew. The text at hand still decides: the runner-up is probed by
the session's own count, a free drafter is tried by each session itself (``own_first``), and
one round of its own replaces the pool's word on an arm (a pooled rate mixes texts: the
n-gram lookup is far the best on a summary of the prompt and poor elsewhere).

A round is not measured when it holds a prompt prefill that no later round pays: the
session's first, and one in which a model drafter drafts for the first time in the session.
Routing by the score alone (CoSine as published) is the arm TOP: whichever drafter the score
ranks first, against none. vLLM and SGLang users know the none arm as dynamic speculation
(turned off where it does not pay)."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

WINDOW = 8  # measured rounds per arm the rates are taken over
PROBE_EVERY = 16  # rounds in a row on the fastest arm before a runner-up with a full window is tried once
SPEC_FIRST = 2  # measured rounds of the best-ranked arm before any other is tried
PLAIN = -1  # the arm of a plain round: no drafter
TOP = -2  # the arm "whichever drafter the routing score ranks first" (routing by the score alone)

Round = tuple[int, float]  # (tokens committed, seconds)


def rate(rounds: Sequence[Round]) -> float:
    """Committed tokens per second over the rounds (0 when no time was measured)."""
    seconds = sum(s for _, s in rounds)
    return sum(t for t, _ in rounds) / seconds if seconds > 0 else 0.0


def next_arm(measured: Mapping[int, Sequence[Round]], order: Sequence[int], current: int | None,
             streak: int, pooled: Mapping[int, Sequence[Round]] | None = None,
             own_first: Collection[int] = ()) -> int:
    """The arm of the next round (pure). ``order``: the arms to choose from, best-ranked first;
    ``measured``: each arm's measured rounds in this session; ``current``: the arm of the last
    round (None before the first) and ``streak`` how many rounds in a row it was taken;
    ``pooled``: each arm's last rounds measured by every session of the target (``seen``);
    ``own_first``: arms the session tries itself though the pool knows them (a free drafter:
    trying it costs no drafting, and where it is best — the n-gram lookup on a summary of the
    prompt — it is best by far, on texts the pool's rate says little about)."""
    seen = {arm: as_seen(measured.get(arm, ()), (pooled or {}).get(arm, ())) for arm in order}
    top = order[0]
    if len(order) == 1 or len(measured.get(top, ())) + len((pooled or {}).get(top, ())) < SPEC_FIRST:
        return top
    untried = next((arm for arm in order if not seen[arm] or (arm in own_first and not measured.get(arm))), None)
    if untried is not None:
        return untried
    best, runner_up = sorted(order, key=lambda arm: -rate(seen[arm]))[:2]  # of equals the better-ranked
    if current == best and streak >= probe_after(len(measured.get(runner_up, ()))):
        return runner_up
    return best


def as_seen(own: Sequence[Round], pooled: Sequence[Round]) -> list[Round]:
    """The rounds a session judges an arm by: its own once it has any, else the pooled ones."""
    return list(own) if own else list(pooled)[-WINDOW:]


def probe_after(rounds: int) -> int:
    """Rounds in a row on the best arm before another is tried once, by how many measured rounds
    that one has: an arm judged on one or two rounds (a speculative round's tokens vary from 1 to
    d + 1) is tried again soon, one with a full window after PROBE_EVERY."""
    return max(2, PROBE_EVERY * rounds // WINDOW)


def arms(ranked: Sequence[int], by_rate: bool, plain: bool) -> list[int]:
    """The arms a round may take, best-ranked first: each drafter that is up (``ranked``, by
    routing score) or, routing by the score alone, TOP; then none where plain rounds may be taken."""
    drafters = list(ranked) if by_rate and ranked else [TOP]
    return drafters + ([PLAIN] if plain else [])


@dataclass(slots=True)
class PaysGate:
    """One session's choice among its arms (``next_arm``)."""

    measured: dict[int, deque] = field(default_factory=dict)  # arm -> its last WINDOW measured rounds
    # the target's: arm -> its last WINDOW measured rounds of all sessions, as (gate, round) so
    # that a session does not count its own twice; shared by its sessions' gates; None: not shared
    pooled: dict[int, deque] | None = None
    current: int | None = None  # the arm of the round in flight (or of the last one)
    streak: int = 0  # rounds in a row on that arm
    started: float | None = None  # when the round in flight was asked for; None: none in flight
    counted: bool = False  # the round in flight is measured

    def begin(self, order: Sequence[int], now: float, own_first: Collection[int] = ()) -> int:
        """A round starts: its arm, one of ``order`` (``own_first``: as ``next_arm``)."""
        others = None if self.pooled is None else \
            {arm: [r for gate, r in rounds if gate is not self] for arm, rounds in self.pooled.items()}
        arm = next_arm(self.measured, order, self.current, self.streak, others, own_first)
        self.counted = self.current is not None  # the session's first round holds the prompt prefill
        self.streak = self.streak + 1 if arm == self.current else 1
        self.current, self.started = arm, now
        return arm

    def uncounted(self) -> None:
        """The round in flight holds a model drafter's first draft in this session (its prompt prefill)."""
        self.counted = False

    @property
    def plain(self) -> bool:
        return self.current == PLAIN

    def end(self, tokens: int, now: float) -> None:
        """The round in flight committed ``tokens``."""
        if self.started is None:
            return
        if self.counted:
            measured = (tokens, now - self.started)
            self.measured.setdefault(self.current, deque(maxlen=WINDOW)).append(measured)
            if self.pooled is not None:
                self.pooled.setdefault(self.current, deque(maxlen=WINDOW)).append((self, measured))
        self.started = None
