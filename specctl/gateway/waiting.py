"""Generations waiting for a free session on a target instance, first come first served.

Choice made here (as vLLM's scheduler queues what does not fit, instead of refusing it): when
every target instance that is up is at capacity, a generation waits in this line rather than
getting a 503 at once. The line is bounded — at most ``max_waiting`` generations
(``specctl gateway --max-waiting``), each at most ``timeout_s`` (``--queue-timeout``) — and
past either bound the answer is the 503 with Retry-After it was before. No one overtakes: a
newcomer joins the back while anyone waits, and only the head of the line tries for a slot.
The head is woken when a generation through this gateway ends, and checks again every
``recheck_s`` on its own (sessions other clients hold end without telling the gateway)."""

from __future__ import annotations

import asyncio
import collections

from specctl.gateway.api import ApiError


class WaitingLine:
    def __init__(self, max_waiting: int = 1024, timeout_s: float = 600.0, recheck_s: float = 0.5) -> None:
        if max_waiting < 0 or timeout_s < 0 or recheck_s <= 0:
            raise ValueError("max_waiting and timeout_s must be >= 0 and recheck_s > 0, got "
                             f"{max_waiting}, {timeout_s}, {recheck_s}")
        self.max_waiting, self.timeout_s, self.recheck_s = max_waiting, timeout_s, recheck_s
        self._line: collections.deque[asyncio.Future] = collections.deque()

    def __len__(self) -> int:
        return len(self._line)

    async def wait(self, deadline: float | None, front: bool = False) -> float:
        """Waits for this generation's turn to try for a slot: at the back of the line, or at the
        front (``front``: a generation whose turn came but found no slot keeps its place).
        Returns the deadline (set on the first wait); a 503 when the line is full or the
        deadline passes."""
        loop = asyncio.get_running_loop()
        if deadline is None:
            if len(self._line) >= self.max_waiting:
                raise ApiError(503, f"every target instance is at capacity and {len(self._line)} requests are "
                                    f"already waiting (--max-waiting {self.max_waiting}); retry later",
                               type="server_error", code="no_capacity", retry_after=1)
            deadline = loop.time() + self.timeout_s
        turn = loop.create_future()
        self._line.appendleft(turn) if front else self._line.append(turn)
        turn_taken = False  # left to try for a slot (woken, or the head checking on its own)
        try:
            while not turn.done():
                left = deadline - loop.time()
                if left <= 0:
                    raise ApiError(503, f"every target instance stayed at capacity for the {self.timeout_s:g} s this "
                                        f"request may wait (--queue-timeout); retry later",
                                   type="server_error", code="no_capacity", retry_after=1)
                head = self._line[0] is turn
                # the head checks again on its own now and then; the others wait to be woken
                # (asyncio.wait, not wait_for: 3.11's wait_for swallows a cancel that meets a turn given)
                done, _ = await asyncio.wait({turn}, timeout=min(left, self.recheck_s) if head else left)
                if not done and head:
                    break
            turn_taken = True
        finally:
            was_head = bool(self._line) and self._line[0] is turn
            self._remove(turn)
            if not turn_taken and (was_head or turn.done()):  # gave up (timed out, cancelled): the next one's turn
                self.wake()
        return deadline

    def wake(self) -> None:
        """The head's turn to try (a session may have freed)."""
        for turn in self._line:
            if not turn.done():
                turn.set_result(None)
                return

    def _remove(self, turn: asyncio.Future) -> None:
        try:
            self._line.remove(turn)
        except ValueError:
            pass
