"""What the gateway reads in a role's polled stats: an instance's recent throughput, the draft
servers a target instance names."""

from __future__ import annotations

from typing import Sequence

from specctl.errors import ConfigError
from specctl.runtime.loop import parse_hostport

RATE_WINDOW_S = 10.0  # the span a recent throughput is measured over


def recent_rate(samples: Sequence[tuple[float, float]], now: float,
                window_s: float = RATE_WINDOW_S) -> float:
    """Tokens a second over the last ``window_s`` seconds of (time, tokens so far) samples, oldest
    first: from the oldest sample in the window to the newest (0.0 with fewer than two, or when
    a restarted instance's count went back)."""
    recent = [(t, n) for t, n in samples if now - t <= window_s]
    if len(recent) < 2 or recent[-1][0] <= recent[0][0] or recent[-1][1] < recent[0][1]:
        return 0.0
    return (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])


def draft_servers(stats: dict) -> list[str]:
    """The draft servers a target instance's stats name: its one draft, or those of its
    several drafters (``verify --draft A --draft B --draft ngram``: the local lookups are not servers)."""
    named = [stats.get("draft_address"), *stats.get("drafters", {})]
    return [name for name in named if name and _is_hostport(name)]


def _is_hostport(name: str) -> bool:
    try:
        parse_hostport(name)
    except ConfigError:
        return False
    return True
