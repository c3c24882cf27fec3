"""What the monitor shows, as immutable values computed by pure functions from stats
feeds (the gateway's /v1/stats, or the same shape assembled from the roles directly)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specctl.errors import unreachable_reason

HISTORY = 60  # sparkline points


@dataclass(frozen=True, slots=True)
class MonitorState:
    source: str
    feed: dict | None = None  # the latest feed; None until the first answer
    error: str = ""  # why the last poll failed (the source is shown as down)
    polled_at: float = 0.0
    token_counts: tuple[tuple[str, int], ...] | None = None  # each answering target's token counter at polled_at
    rate_history: tuple[float, ...] = field(default_factory=tuple)  # total tokens/s per poll
    recent: dict = field(default_factory=dict)  # address -> rates over the last interval (read-only)


def token_counts(feed: dict) -> tuple[tuple[str, int], ...]:
    return tuple((t.get("address", ""), int(t.get("stats", {}).get("tokens", 0)))
                 for t in feed.get("targets", []) if t.get("up"))


def tokens_between(before: tuple[tuple[str, int], ...], after: tuple[tuple[str, int], ...]) -> int:
    """Tokens produced between two polls by the targets that answered both (a restarted
    target's counter starts again from zero, so it never counts negative)."""
    old = dict(before)
    return sum(max(0, count - old[address]) for address, count in after if address in old)


def recent_rates(before: dict, after: dict, seconds: float) -> dict:
    """Rates and means of one role over the interval between two of its snapshots (the
    lifetime counters differenced), so the screen shows what happens now, not since start.
    Empty when the counters went backwards (the role restarted) or no time passed."""
    delta = lambda key: float(after.get(key, 0)) - float(before.get(key, 0))  # noqa: E731
    if seconds <= 0 or delta("jobs") < 0 or delta("busy_s") < 0:
        return {}
    jobs, passes = delta("jobs"), delta("passes")
    out = {
        "load": round(min(1.0, delta("busy_s") / seconds), 4),
        "t_s_ms": round(1e3 * delta("busy_s") / jobs, 3) if jobs else 0.0,
        "T_wait_ms": round(1e3 * delta("wait_s") / jobs, 3) if jobs else 0.0,
        "T_idle_ms": round(1e3 * delta("idle_s") / passes, 3) if passes else 0.0,
        "mean_batch": round(jobs / passes, 3) if passes else 0.0,
        "R_q": round(jobs / seconds, 3),
    }
    if "tokens" in after:  # a target instance
        out["R_p"] = round(max(0.0, delta("rounds")) / seconds, 3)
        out["tokens_per_s"] = round(max(0.0, delta("tokens")) / seconds, 3)
    return out


def _roles(feed: dict | None) -> dict[str, dict]:
    return {r.get("address", ""): r for r in (feed or {}).get("drafters", []) + (feed or {}).get("targets", [])
            if r.get("up") and r.get("seen_at")}


def advance_recent(previous: dict, old_feed: dict | None, new_feed: dict) -> dict:
    old, out = _roles(old_feed), {}
    for address, role in _roles(new_feed).items():
        before = old.get(address)
        if before is None:
            continue
        if role["seen_at"] <= before["seen_at"]:  # nothing fresher: keep what was shown
            if address in previous:
                out[address] = previous[address]
            continue
        rates = recent_rates(before.get("stats", {}), role.get("stats", {}), role["seen_at"] - before["seen_at"])
        if rates:
            out[address] = rates
    return out


def shown(role: dict, state: "MonitorState") -> dict:
    """A role's stats as the screen shows them: recent rates over lifetime averages."""
    return {**role.get("stats", {}), **state.recent.get(role.get("address", ""), {})}


def data_time(feed: dict, now: float) -> float:
    """When the targets' numbers were taken: a gateway relays what it polled earlier."""
    seen = [t["seen_at"] for t in feed.get("targets", []) if t.get("up") and t.get("seen_at")]
    return max(seen) if seen else now


def advance(state: MonitorState, feed: dict | None, now: float, error: str = "") -> MonitorState:
    """The next state after a poll: a new feed (with the tokens/s since the last fresh
    numbers added to the history) or, when the poll failed, the same data marked with the
    error. A relayed feed with no fresher numbers leaves the history alone."""
    if feed is None:
        return MonitorState(state.source, state.feed, error or "no answer", state.polled_at, None, state.rate_history)
    at, counts = data_time(feed, now), token_counts(feed)
    history = state.rate_history
    recent = advance_recent(state.recent, state.feed, feed)
    if state.token_counts is not None and at <= state.polled_at:
        return MonitorState(state.source, feed, "", state.polled_at, state.token_counts, history, recent)
    if state.token_counts is not None:
        rate = tokens_between(state.token_counts, counts) / (at - state.polled_at)
        history = (history + (round(rate, 3),))[-HISTORY:]
    return MonitorState(state.source, feed, "", at, counts, history, recent)


@dataclass(frozen=True, slots=True)
class Regime:
    targets: int  # target instances connected to the draft server
    n_full: int | None  # None while there is not enough to estimate it
    label: str


def star_regime(draft_stats: dict, target_stats: list[dict]) -> Regime:
    """StarSD's regime from measured times: S = the draft's time per request (t_s_ms),
    Z ~ the targets' verification time per job (loopback communication is negligible),
    N_full = ceil(Z/S) + 1; fully loaded once N >= N_full (DESIGN §4)."""
    n = int(draft_stats.get("targets", 0))
    service = float(draft_stats.get("t_s_ms", 0.0))
    verify = [float(s.get("t_s_ms", 0.0)) for s in target_stats if s.get("t_s_ms")]
    if service <= 0 or not verify:
        return Regime(n, None, "idle" if n == 0 else "measuring")
    n_full = math.ceil((sum(verify) / len(verify)) / service) + 1
    return Regime(n, n_full, "fully loaded" if n >= n_full else "under-loaded")


def poll_error(source: str, exc: BaseException) -> str:
    """What the dashboard says when a poll of ``source`` failed: a connection that could not
    be made in a few words (why), anything else as its type and message."""
    reason = unreachable_reason(exc)
    if reason:
        return f"cannot reach {source} ({reason})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
