"""Rounds a session's speculator sits out, and what it is told when it is asked again.

Two wrappers answer some rounds themselves and leave the others to an inner speculator (a
draft server, a drafter here, the fused drafters): the request's prediction
(``spec.prediction``), and the instance's load (``SpeculationByLoad``: plain rounds while a
target runs more sessions than speculation pays for, shorter chains as its batch grows). When
asked again the inner speculator
is told, in one outcome, its last proposal's accepted path and every token committed since
it last proposed (``InnerTurns``), as a fused drafter that sat rounds out is."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from specctl.spec.rounds import Drafted, Speculator

if TYPE_CHECKING:  # it imports this module
    from specctl.spec.depth_tuning import DepthTuner

Outcome = tuple[list[int], list[int]]  # (the last proposal's accepted path, the tokens committed since)
# How long an instance counts as loaded after it last ran more sessions than its limit. A client's
# next request follows its last within milliseconds, and a draft that sat rounds out catches up on
# them in one forward (on the whole prompt, where it never drafted): speculating through such a
# dip cost more than it gained (bench serve at 4 clients, limit 3: 18.5-18.8 tok/s in two of
# three runs, against 20.1-20.6 for plain rounds throughout).
LOAD_HOLD_S = 1.0


class InnerTurns:
    """Where the inner speculator stands: the text's length when it last proposed and that
    proposal's accepted path."""

    __slots__ = ("synced", "path", "asked_last")

    def __init__(self) -> None:
        self.synced: int | None = None  # None: not asked yet (it stands at the prompt's end)
        self.path: list[int] = []
        self.asked_last = False  # the round the wrapper was last asked for was the inner speculator's

    def round_ended(self, path: list[int]) -> None:
        """The accepted path of the round the wrapper was last asked for."""
        if self.asked_last:
            self.path, self.asked_last = list(path), False

    def outcome(self, session) -> Outcome | None:
        """What to tell the inner speculator, asked now: None when the last round was its own
        (nothing came between)."""
        synced = session.prompt_len if self.synced is None else self.synced
        before_last = len(session.seq) - len(session.last_committed)
        told = None if synced == before_last else (self.path, session.seq[synced:])
        self.synced, self.path, self.asked_last = len(session.seq), [], True
        return told


class SpeculationByLoad:
    """Each round as ``plan()`` says from the instance's load: None, a plain round (past
    spec_max_sessions: vLLM's ``speculative_disable_by_batch_size``, asked every round rather
    than once a request, so a session speculates again once the load falls); else a proposal
    at most that many tokens deep (0: the drafter's own depth; spec_depth_by_load, as
    SmartSpec shortens proposals as the batch grows). A plain round verifies the root alone
    and a shorter chain accepts what it holds: slower or faster for that session, never
    different."""

    def __init__(self, inner: Speculator, plan: Callable[[], int | None], tuner: "DepthTuner | None" = None) -> None:
        """``tuner``: a spec.depth_tuning.DepthTuner choosing the rounds ``plan`` leaves to
        speculation (spec_depth_by_load "auto"), told how deep each drafted and what it accepted."""
        self.inner, self.plan, self.tuner = inner, plan, tuner
        self.max_nodes = inner.max_nodes
        self.turns = InnerTurns()
        self.ticket, self.drafted = None, 0  # the tuner's round in flight and how deep it drafted
        self.prefill_told = False

    def begin(self, session) -> None:
        self.inner.begin(session)

    async def propose(self, session, outcome: Outcome | None = None) -> Drafted:
        """``outcome``: from a wrapper outside this one (the prediction), whose rounds came between."""
        self.turns.round_ended(session.last_path if outcome is None else outcome[0])
        if self.tuner is not None and not self.prefill_told:  # its prompt's prefill held up every round
            self.tuner.stalled(session.stats.prefill_compute_s)
            self.prefill_told = True
        last, self.ticket = self.ticket, None
        if last is not None and outcome is None:  # (rounds between: the last path is not its own)
            self.tuner.ended(last, self.drafted, len(session.last_path))
        max_depth = self.plan()
        if max_depth is not None and self.tuner is not None:
            max_depth, self.ticket = self.tuner.plan(last if outcome is None else None)
            self.drafted = 0
        if max_depth is None:
            return Drafted(None, 0.0, by_load=True)
        drafted = await self.inner.propose(session, self.turns.outcome(session), max_depth=max_depth)
        if drafted.proposal is not None:
            self.drafted = int(drafted.proposal.tree.max_depth)
        return drafted

    def close(self) -> None:
        self.inner.close()


def depth_for_load(active: int, schedule: tuple[tuple[int, int], ...]) -> int:
    """The deepest proposal an instance running ``active`` sessions asks for: the depth of the
    schedule's largest session count at or below ``active`` ((sessions, depth) pairs, counts
    ascending); 0 (the drafter's own) below the first."""
    depth = 0
    for sessions, capped in schedule:
        if active >= sessions:
            depth = capped
    return depth


class LoadHold:
    """Whether an instance running ``active`` sessions is loaded past ``limit``: it is, and for
    ``hold_s`` after it last was (one per instance, asked by every session's round)."""

    def __init__(self, limit: int, hold_s: float = LOAD_HOLD_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.hold_s, self.clock = limit, hold_s, clock
        self.until = float("-inf")

    def __call__(self, active: int) -> bool:
        if active > self.limit:
            self.until = self.clock() + self.hold_s
        return self.held()

    def held(self) -> bool:
        """Loaded now, as the rounds last found (the stats feed's ``spec_held``)."""
        return self.clock() < self.until
