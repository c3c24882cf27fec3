"""Where a request goes: pure decisions over immutable views of the target instances."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TargetView:
    up: bool
    inflight: int  # requests this gateway has running there
    capacity: int  # the instance's max_sessions (from its handshake)
    sessions: int = 0  # sessions it reported in its last stats (other clients included)


def pick_target(views: list[TargetView], exclude: frozenset[int] = frozenset()) -> int | None:
    """Least loaded first: fewest of our requests in flight, then fewest sessions reported,
    then the lowest index. None when every instance is down, full or excluded."""
    open_ = [i for i, v in enumerate(views) if v.up and v.inflight < v.capacity and i not in exclude]
    if not open_:
        return None
    return min(open_, key=lambda i: (views[i].inflight, views[i].sessions, i))
