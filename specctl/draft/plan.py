"""StarSD's analytical model (paper §3-4, DESIGN §4) as pure functions, used by
``specctl plan``, by admission on the draft server and by the monitor.

E[l(d)] = β(1-β^d)/(1-β)          expected accepted draft tokens per round
S(d)    = d·t_s                    draft service time of one depth-d request
Z(d)    = t_c + t_v                return time: communication + verification
T_idle  = max(0, Z - (N-1)·S)      the draft's idle gap per round
T       = N·S + T_idle             round time with N targets
O       = N·E[l]/T,  O_i = E[l]/T  system and per-target throughput (tokens/s)
N_full  = ceil(Z/S) + 1            the first N at which the draft never idles
N_max   = the largest N with O_i >= the target's standalone speed

With pre-speculation (SSD's round on the star; h = the share of rounds answered from a ready branch):
T_pre   = max(h·max(Z, S) + (1-h)(Z + S) + w, N·(1-h)·S)   a ready hit answers at once (or when
                                                          drafting that outlasts the verification
                                                          ends), a miss is drafted then; the draft
                                                          is bound by N misses
w       = f/2 for N >= 2, 0 for N = 1                    a request waits out the background step
                                                          (of length f) in flight"""

from __future__ import annotations

import math
from typing import Any
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StarModel:
    t_s: float  # draft time per drafted token, seconds
    t_v: float  # verification time per round, seconds
    t_c: float  # communication time per round, seconds
    beta: float  # per-token acceptance probability
    depth: int

    def __post_init__(self) -> None:
        if not all(math.isfinite(x) for x in (self.t_s, self.t_v, self.t_c, self.beta)):
            raise ValueError("t_s, t_v, t_c and beta must be finite numbers")
        if self.t_s <= 0 or self.t_v < 0 or self.t_c < 0:
            raise ValueError("t_s must be > 0 and t_v, t_c >= 0")
        if not 0 <= self.beta < 1:
            raise ValueError(f"beta must be in [0, 1), got {self.beta}")
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")

    @property
    def expected_accepted(self) -> float:
        b, d = self.beta, self.depth
        return b * (1 - b**d) / (1 - b)

    @property
    def service(self) -> float:
        return self.depth * self.t_s

    @property
    def return_time(self) -> float:
        return self.t_c + self.t_v

    def idle(self, n: int) -> float:
        return max(0.0, self.return_time - (n - 1) * self.service)

    def round_time(self, n: int) -> float:
        return n * self.service + self.idle(n)

    def system_throughput(self, n: int) -> float:
        return n * self.expected_accepted / self.round_time(n)

    def per_target_throughput(self, n: int) -> float:
        return self.expected_accepted / self.round_time(n)

    def load(self, n: int) -> float:
        """Fraction of the round the draft computes."""
        return n * self.service / self.round_time(n)

    @property
    def n_full(self) -> int:
        return math.ceil(self.return_time / self.service) + 1

    def regime(self, n: int) -> str:
        return "fully loaded" if n >= self.n_full else "under-loaded"

    def n_max(self, standalone_tokens_per_s: float | None, limit: int = 4096) -> int:
        """Largest N whose per-target throughput stays at or above the standalone speed
        (N_full when no standalone speed is known; 0 when even N=1 is slower)."""
        if standalone_tokens_per_s is None:
            return self.n_full
        n = 0
        while n < limit and self.per_target_throughput(n + 1) >= standalone_tokens_per_s:
            n += 1
        return n


def prespec_round_time(n: int, ready: float, service: float, return_time: float, step: float = 0.0,
                       at_once: float = 0.0, own_return: float | None = None) -> float:
    """A target's round with pre-speculation on a star of ``n`` targets (seconds): SSD's round
    (Theorem 7, a just-in-time fallback) or, when the n targets' misses alone keep the draft busy,
    StarSD's N·S with only the misses as service. Background drafting costs no round time but
    two things: its share of the draft shows in ``ready`` (a draft with no time left for
    branches has fewer ready hits), and with other targets' branches being drafted a request
    arrives at a random point of a draft ``step`` and waits out the rest, half a step on average
    (a fixed-length step's mean residual). At N = 1 the only steps are the target's own, whose
    timing SSD's max(Z, S) already holds.
    ``at_once``: the share of rounds (within ``ready``) the event loop answered at once from a
    published branch (draft.early): theirs is the target's own side of a round, ``own_return``
    (plain's round less the target's wait for its proposal), not max(Z, S): Z measured on plain
    speculation also holds draft-side time that an answer at once skips."""
    if n < 1 or not 0.0 <= ready <= 1.0 or service <= 0 or return_time < 0 or step < 0 or not 0.0 <= at_once <= ready:
        raise ValueError(f"need n >= 1, ready in [0, 1], service > 0, return_time >= 0, step >= 0, at_once in "
                         f"[0, ready]; got n={n}, ready={ready}, service={service}, return_time={return_time}, "
                         f"step={step}, at_once={at_once}")
    own = return_time if own_return is None else min(max(own_return, 0.0), return_time)
    single = at_once * own + (ready - at_once) * max(return_time, service) + (1 - ready) * (return_time + service)
    wait = step / 2 if n >= 2 else 0.0
    return max(single + wait, n * (1 - ready) * service)


def admit(active_targets: int, model: StarModel | None, standalone_tokens_per_s: float | None) -> bool:
    """StarSD's admission rule: refuse a new target instance when N would exceed N_max."""
    if model is None or standalone_tokens_per_s is None:
        return True
    return active_targets + 1 <= model.n_max(standalone_tokens_per_s)


def open_refusal(config: Any, open_sessions: int, connection_sessions: int,
                 other_targets: int) -> tuple[str, str] | None:
    """Why a new session is refused — (error code, message) — or None to open it: the server's
    and the connection's session limits, then, for a target's first session, StarSD's admission
    rule (``other_targets``: instances with sessions open, this one left out)."""
    if open_sessions >= config.max_sessions:
        return "capacity", f"draft server full: {config.max_sessions} sessions open; retry later"
    if connection_sessions >= config.max_sessions_per_connection:
        return "capacity", f"at most {config.max_sessions_per_connection} sessions per connection"
    if not connection_sessions and not admit(other_targets, config.admission_model, config.standalone_tokens_per_s):
        return "admission", "draft server at N_max: another target would run slower than standalone"
    return None
