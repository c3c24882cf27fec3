"""Generations waiting for a free session on a target instance: first come first served, or
by vLLM's request ``priority`` (lower first, then arrival) with ``--scheduling-policy priority``.

Choice made here (as vLLM's scheduler queues what does not fit, instead of refusing it): when
every target instance that is up is at capacity, a generation waits in this line rather than
getting a 503 at once. The line is bounded — at most ``max_waiting`` generations
(``specctl gateway --max-waiting``), each at most ``timeout_s`` (``--queue-timeout``) — and
past either bound the answer is the 503 with Retry-After it was before. No one overtakes: a
newcomer waits while anyone of its priority or better waits, only the head of the line tries
for a slot, and a turn that found no slot goes back to its place (its arrival). The head is
woken when a generation through this gateway ends, and checks again every ``recheck_s`` on
its own (sessions other clients hold end without telling the gateway)."""

from __future__ import annotations

import asyncio
import bisect
import itertools
from dataclasses import dataclass

from specctl.gateway.api import ApiError


@dataclass(slots=True, frozen=True)
class Ticket:
    """A generation's place in the line, kept across its turns."""
    priority: int
    arrival: int
    deadline: float


class WaitingLine:
    def __init__(self, max_waiting: int = 1024, timeout_s: float = 600.0, recheck_s: float = 0.5) -> None:
        if max_waiting < 0 or timeout_s < 0 or recheck_s <= 0:
            raise ValueError("max_waiting and timeout_s must be >= 0 and recheck_s > 0, got "
                             f"{max_waiting}, {timeout_s}, {recheck_s}")
        self.max_waiting, self.timeout_s, self.recheck_s = max_waiting, timeout_s, recheck_s
        self._line: list[tuple[int, int, asyncio.Future]] = []  # (priority, arrival, turn), in that order
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._line)

    def ahead(self, priority: int = 0) -> bool:
        """Whether a newcomer of ``priority`` must wait behind someone (of its priority or better)."""
        return bool(self._line) and self._line[0][0] <= priority

    def ticket(self, priority: int = 0) -> Ticket:
        """A newcomer's place: a 503 when the line is full."""
        if len(self._line) >= self.max_waiting:
            raise ApiError(503, f"every target instance is at capacity and {len(self._line)} requests are already "
                                f"waiting (--max-waiting {self.max_waiting}); retry later",
                           type="server_error", code="no_capacity", retry_after=1)
        return Ticket(priority, next(self._arrivals), asyncio.get_running_loop().time() + self.timeout_s)

    async def wait(self, ticket: Ticket) -> None:
        """Waits for this generation's turn to try for a slot, at its ticket's place; a 503 when
        its deadline passes."""
        loop = asyncio.get_running_loop()
        turn = loop.create_future()
        entry = (ticket.priority, ticket.arrival, turn)
        bisect.insort(self._line, entry, key=lambda e: e[:2])
        turn_taken = False  # left to try for a slot (woken, or the head checking on its own)
        try:
            while not turn.done():
                left = ticket.deadline - loop.time()
                if left <= 0:
                    raise ApiError(503, f"every target instance stayed at capacity for the {self.timeout_s:g} s this "
                                        f"request may wait (--queue-timeout); retry later",
                                   type="server_error", code="no_capacity", retry_after=1)
                head = self._line[0] is entry
                # the head checks again on its own now and then; the others wait to be woken
                # (asyncio.wait, not wait_for: 3.11's wait_for swallows a cancel that meets a turn given)
                done, _ = await asyncio.wait({turn}, timeout=min(left, self.recheck_s) if head else left)
                if not done and head:
                    break
            turn_taken = True
        finally:
            was_head = bool(self._line) and self._line[0] is entry
            self._line.remove(entry)
            if not turn_taken and (was_head or turn.done()):  # gave up (timed out, cancelled): the next one's turn
                self.wake()

    def wake(self) -> None:
        """The head's turn to try (a session may have freed)."""
        for _, _, turn in self._line:
            if not turn.done():
                turn.set_result(None)
                return
