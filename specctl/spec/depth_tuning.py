"""The proposal depth a target instance's load pays for, learnt from its own rounds
(``spec_depth_by_load = "auto"``).

A fixed schedule (the desktop profile's "3:2") holds for the machine and prompts it was measured on: where the
draft runs elsewhere a draft step costs the target nothing, on a GPU a wider batch costs almost
nothing more, and on other prompts the draft is accepted more or less often. SmartSpec chooses
each batch's proposal length by a goodput estimate; so does the instance, from its own rounds.
It holds one *arm* — a proposal depth (0: the drafter's own, then at most 4, at most 2) or
plain rounds — for an *epoch* (EPOCH_ROUNDS rounds a session, not counting each session's
first, which was batched with the last arm's rounds; and MIN_EPOCH_S at least: a prefill
stalls every round for a while, and a short epoch of plain rounds that met one was rated at
half its speed). An epoch's round time is its session-seconds (the sessions it ran times the
wall time) over the rounds that ended in it: a mean of each round's own time left out the
rounds still running as an epoch ended (the slowest, 10 % short of the mean at 8 clients) and
the time between rounds. Each prompt's prefill comes off those session-seconds (``stalled``:
its compute times the sessions running; a draft server's too where it shares the compute
thread): it held up every arm's rounds alike, so it does not rank them, and at 8 clients on 2
CPU cores a 1.5B target's prefill costs about a batched round while a new request comes about
every third round, so an epoch of 3 rounds a session met one or none and its rate swung by a
third with it. An arm's round time at a load is the median of its epochs'
(an epoch that met a burst of prefills does not outweigh the others). Its rate is the tokens
one of its rounds commits, expected from the acceptance of every recent speculative round (any arm, any load:
what the draft guesses right does not depend on the load), over that time: an epoch's
committed tokens vary with the text far more than its times do (5.6-10.5 tokens/s a session
for one arm at one load, bench serve at 4 clients), and one acceptance compares every arm on
the same text. The acceptance at each position is the share of the rounds that reached it and
accepted it (``acceptance``; one geometric rate fitted to all rounds overrated the caps: 0.9 a
token, where chains capped at 4 accepted 2.3 of 4). At one load the rate is proportional to
the instance's tokens per second. At each load (the most sessions it ran in the last
LOAD_HOLD_S, so that a client's gap between two requests is not a new load) it takes the
fastest arm after trying each (``next_epoch_arm``: every arm once, then
the fastest, and now and then the arm measured least again); a load met for the first
time starts on the arm the nearest load measured found fastest, and tries only that arm and
those past it on the load's side (``toward``: the shallower ones for more sessions, the deeper
for fewer, as SmartSpec's goodput says the best depth falls with the batch): trying every arm at
every load could take most of a one-minute run at 4 clients (loads 1-4, five epochs of 2 s or
more each). Only the next arm on that side was measured to miss: at 8 clients after 4, load 4's
best (the draft's own depth, on one noisy epoch each of the others) left load 8 trying own and 4,
never 2 nor plain rounds (0.85x batched plain decoding in that repeat). Arms are tried rather
than rated by a round time fitted to the depth (SmartSpec's cost model): a plain round costs far
less than a line through speculative rounds says (no draft at all), and at 8 clients on 2 CPU
cores a round of depth 2 took half what the line through depths 4-9 gave. Every arm is
lossless: slower or faster, never different."""

from __future__ import annotations

import logging
import statistics
import time
from collections import Counter, deque
from typing import Callable, Mapping, NamedTuple, Sequence

from specctl.spec.pays import PLAIN, WINDOW, probe_after, rate
from specctl.spec.turns import LOAD_HOLD_S

log = logging.getLogger("specctl.verify.depth")
LADDER = (0, 4, 2)  # proposal depths tried (0: the drafter's own), then plain rounds
EPOCH_ROUNDS = 3  # measured rounds a session per epoch
MIN_EPOCH_S = 2.0  # and at least this long
ACCEPTANCE_ROUNDS = 256  # the recent speculative rounds the acceptance rate is taken over
EPOCHS_LOGGED = 1024  # the last epochs kept in order (``epoch_log``)


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


def typical_round(epochs) -> tuple[float, float]:
    """(drafted depth, seconds) of an arm's round over its (rounds, seconds, drafted) epochs: the
    mean depth, and the median of its epochs' round times — one epoch that met prefills (three
    times as long, at 8 clients) must not outweigh the others, as it did in their sum."""
    rounds = sum(r for r, _, _ in epochs)
    return sum(d for _, _, d in epochs) / rounds, statistics.median(s / r for r, s, _ in epochs)


def next_epoch_arm(measured: Mapping[int, Sequence], order: Sequence[int], current: int | None, streak: int) -> int:
    """The next epoch's arm (pure): as ``spec.pays.next_arm``, every arm once, then the fastest,
    but the first arm once, not SPEC_FIRST times (an epoch is many rounds; at the first load met
    the first arm is the draft's own depth, which at 4 clients took 1.0-1.4 s a round, so its two
    epochs took 13 s of a one-minute run at 0.6-0.7 of the best arm's rate); and a probe goes to
    the arm with the fewest epochs measured (of equals the faster), not always the runner-up: an
    epoch's rate swung with the prefills it met (before they were left out, ``stalled``) and
    swings with the text, so an arm rated low on one epoch must be tried again. Probing the
    runner-up alone never did: at 8 clients chains of at most 2, the tuned schedule's arm there,
    were rated on one epoch at half plain rounds' rate and never tried again."""
    top = order[0]
    if len(order) == 1 or not measured.get(top):
        return top
    untried = next((arm for arm in order if not measured.get(arm)), None)
    if untried is not None:
        return untried
    best = max(order, key=lambda arm: (rate(measured[arm]), -order.index(arm)))
    probe = min((arm for arm in order if arm != best), key=lambda arm: (len(measured[arm]), -rate(measured[arm])))
    return probe if current == best and streak >= probe_after(len(measured[probe])) else best


def toward(ladder: list[int], best: int, more_sessions: bool) -> list[int]:
    """``best`` and the arms past it on the ``ladder`` (deepest first, plain rounds last) on the
    load's side, nearest first: the shallower ones for more sessions, the deeper for fewer."""
    at = ladder.index(best)
    return [best, *(ladder[at + 1:] if more_sessions else ladder[:at][::-1])]


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
                 hold_s: float = LOAD_HOLD_S, min_epoch_s: float = MIN_EPOCH_S) -> None:
        """``load``: the sessions the instance runs now. (The draft's own depth is not known
        here — a draft server elsewhere chose it — so a cap at or above it is tried too: one
        wasted epoch or so a load.)"""
        self.load, self.clock, self.min_epoch_s = load, clock, min_epoch_s
        self.arms = [*LADDER, PLAIN]
        self.peak = PeakLoad(hold_s, clock)
        # load -> arm -> its last WINDOW epochs (rounds, seconds, drafted tokens)
        self.measured: dict[int, dict[int, deque]] = {}
        self.candidates: dict[int, list[int]] = {}  # load -> the arms it tries, best-ranked first (``order``)
        self.epochs_kept: dict[int, Counter] = {}  # load -> arm -> epochs measured, all of them (``report``)
        self.kept_in_order: deque = deque(maxlen=EPOCHS_LOGGED)  # (``epoch_log``)
        self.accepted: deque = deque(maxlen=ACCEPTANCE_ROUNDS)  # (accepted, drafted) of speculative rounds
        self.level: int | None = None  # the load of the epoch in progress
        self.arm, self.streak, self.epoch = self.arms[0], 0, 0
        # the epoch's rounds: measured, ended (its tickets'), their drafted tokens, and the
        # session-seconds since it began (sessions times wall time, summed as the load changes)
        self.rounds, self.ended_rounds, self.drafted, self.seconds = 0, 0, 0, 0.0
        self.active, self.since = 0, clock()
        self.started = self.born = self.since  # when the epoch began; when the tuner did
        self.stalled_s = 0.0  # prefill compute left out of the epochs, all of it (``snapshot``)

    def plan(self, last: Ticket | None) -> tuple[int | None, Ticket]:
        """A session's next round: None for a plain round, else its deepest proposal (0: the
        drafter's own), and its ticket; ``last``: the session's previous round's ticket."""
        now, active = self._accrue()
        level = self.peak(active)
        if level != self.level:
            self._end_epoch(keep=self.level is not None and self.rounds >= self.level)
            self.level, self.streak = level, 0
            self._next_arm()
        elif self.rounds >= EPOCH_ROUNDS * max(level, 1) and now - self.started >= self.min_epoch_s:
            self._end_epoch(keep=True)
            self._next_arm()
        measured = last is not None and last.epoch == self.epoch
        return (None if self.arm == PLAIN else self.arm), Ticket(self.epoch, measured)

    def ended(self, ticket: Ticket, drafted: int, accepted: int) -> None:
        """The round of ``ticket`` accepted ``accepted`` of its ``drafted`` tokens deep proposal."""
        if drafted > 0:
            self.accepted.append((accepted, drafted))
        if ticket.epoch == self.epoch:
            self.rounds += ticket.measured
            self.ended_rounds, self.drafted = self.ended_rounds + 1, self.drafted + drafted

    def stalled(self, seconds: float) -> None:
        """A prompt's prefill just took ``seconds`` of the instance's compute, which every session
        running waited out (its own included): the epoch's session-seconds lose them."""
        _, active = self._accrue()
        self.seconds = max(0.0, self.seconds - active * seconds)
        self.stalled_s += seconds

    def _accrue(self) -> tuple[float, int]:
        """The epoch's session-seconds up to now (the sessions running times the wall time since
        the last call); the time now and the sessions running now."""
        now, active = self.clock(), self.load()
        self.seconds += self.active * (now - self.since)
        self.active, self.since = active, now
        return now, active

    def _end_epoch(self, keep: bool) -> None:
        """Keep the epoch's rounds (ended in it), session-seconds and drafted tokens for its arm
        at its load (``keep``), and begin the next."""
        if keep and self.seconds > 0 and self.ended_rounds:
            arms = self.measured.setdefault(self.level, {})
            arms.setdefault(self.arm, deque(maxlen=WINDOW)).append((self.ended_rounds, self.seconds, self.drafted))
            self.epochs_kept.setdefault(self.level, Counter())[self.arm] += 1
            round_ms, drafted = 1000 * self.seconds / self.ended_rounds, self.drafted / self.ended_rounds
            self.kept_in_order.append({"load": self.level, "arm": arm_name(self.arm), "round_ms": round(round_ms, 1),
                                       "drafted": round(drafted, 2), "ended_s": round(self.since - self.born, 2)})
            log.debug("load %d, depth %s: %.0f ms a round, %.1f drafted", self.level, arm_name(self.arm), round_ms,
                      drafted)
        self.rounds, self.ended_rounds, self.drafted, self.seconds = 0, 0, 0, 0.0
        self.epoch, self.started = self.epoch + 1, self.since

    def rated(self, level: int) -> dict[int, list[tuple[float, float]]]:
        """Each arm measured at ``level``: its epochs as (expected tokens, seconds) of its typical
        round, as many as it has epochs (``next_epoch_arm`` reads their count)."""
        by_position = acceptance(self.accepted)
        rated = {}
        for arm, epochs in self.measured.get(level, {}).items():
            depth, seconds = typical_round(epochs)
            rated[arm] = [(expected_tokens(by_position, depth) if arm != PLAIN else 1.0, seconds)] * len(epochs)
        return rated

    def _next_arm(self) -> None:
        measured = self.rated(self.level)
        arm = next_epoch_arm(measured, self.order(self.level), self.arm if self.streak else None, self.streak)
        self.streak = self.streak + 1 if arm == self.arm else 1
        self.arm = arm

    def order(self, level: int) -> list[int]:
        """The arms a load tries, best-ranked first, chosen when it is first met: every arm in the
        ladder's order for the first load; for a later one the arm the nearest load measured found
        fastest and those past it on this load's side (``toward``). Its own rates rank them once it
        has them (``next_epoch_arm``)."""
        if level not in self.candidates:
            known = [other for other, arms in self.measured.items() if arms and other != level]
            if not known:
                self.candidates[level] = list(self.arms)
            else:
                near = min(known, key=lambda other: (abs(other - level), other))
                rated = self.rated(near)
                best = max(rated, key=lambda arm: (rate(rated[arm]), -self.arms.index(arm)))
                self.candidates[level] = toward(self.arms, best, level > near)
        return self.candidates[level]

    def report(self) -> dict:
        """What it learnt, load by load (a benchmark's record): each arm's epochs measured and its
        rate (expected tokens a second a session, over its last epochs there)."""
        return {str(level): {arm_name(arm): {"epochs": count, "rate": round(rate(self.rated(level).get(arm, ())), 3)}
                             for arm, count in sorted(counts.items(), key=lambda item: self.arms.index(item[0]))}
                for level, counts in sorted(self.epochs_kept.items())}

    def epoch_log(self) -> list[dict]:
        """The epochs kept, in order (the last EPOCHS_LOGGED; a benchmark's record, and what the
        debug log says): each one's load, arm, round time (its session-seconds over its rounds,
        prefills left out), mean drafted depth and when it ended (seconds since the tuner began)."""
        return list(self.kept_in_order)

    def snapshot(self) -> dict:
        """The stats feed's: the arm now, its load, and each arm's rate at that load (expected
        tokens a second a session)."""
        rates = {arm_name(arm): round(rate(epochs), 3) for arm, epochs in self.rated(self.level).items()}
        return {"spec_depth_now": arm_name(self.arm), "spec_depth_cap": self.arm, "spec_depth_load": self.level or 0,
                "spec_depth_rates": rates, "spec_depth_epochs": self.epoch,
                "spec_depth_prefill_s": round(self.stalled_s, 3),
                "spec_depth_acceptance": [round(share, 3) for share in acceptance(self.accepted)]}
