"""Where a request goes: pure decisions over immutable views of the target instances."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TargetView:
    up: bool
    inflight: int  # requests this gateway has running there
    capacity: int  # the instance's max_sessions (from its handshake)
    sessions: int = 0  # sessions it reported in its last stats (other clients included)
    prefix_match: int = 0  # the longest start this request shares with a prompt the instance prefilled lately


CACHE_WORTH = 16  # prompt tokens: a shorter shared start is not worth a less loaded instance (as the cache's own floor)
BALANCE = 1  # requests in flight an instance may have beyond the least loaded one's and still get a request for its cache


def pick_target(views: list[TargetView], exclude: frozenset[int] = frozenset()) -> int | None:
    """Cache-aware least loaded (as SGLang's router): the instance that prefilled the text this
    request starts with (its prefix cache holds it), unless that instance has more than
    BALANCE requests in flight beyond the least loaded one; otherwise fewest of our requests in
    flight, then fewest sessions reported, then the lowest index. None when every instance is
    down, full or excluded."""
    open_ = [i for i, v in enumerate(views) if v.up and v.inflight < v.capacity and i not in exclude]
    if not open_:
        return None
    least = min(views[i].inflight for i in open_)
    cached = [i for i in open_ if views[i].prefix_match >= CACHE_WORTH and views[i].inflight <= least + BALANCE]
    if cached:
        return max(cached, key=lambda i: (views[i].prefix_match, -views[i].inflight, -views[i].sessions, -i))
    return min(open_, key=lambda i: (views[i].inflight, views[i].sessions, i))
