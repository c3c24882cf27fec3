"""SpecPipe's expected time between tokens (eq. 2), E(T) = t(w) + (1 - P(w)) m t(w), less
what a refill saves, and the tree width w that minimises it, from measured step times t(w)
and hit rates P(w)."""

from __future__ import annotations

from dataclasses import dataclass

from specctl.errors import ConfigError


@dataclass(frozen=True, slots=True)
class WidthOption:
    width: int
    step_ms: float  # t(w): the slowest stage's time for a level of w nodes
    hit_rate: float  # P(w): share of steps whose verified token is in the tree

    def expected_tbt_ms(self, stages: int, refill: int = 0) -> float:
        """E(T) = t (1 + (1 - P) m - P (1 - P^D)). Eq. 2 charges every miss m steps; with a
        refill of D levels sent with the missed token, its output also decides the next i
        tokens with probability P^i (i <= D) at no step of their own: sum_i P^i per miss, so
        (1 - P) * P (1 - P^D) / (1 - P) = P (1 - P^D) steps fewer per token."""
        p = self.hit_rate
        return self.step_ms * (1 + (1 - p) * stages - p * (1 - p ** refill))


def pick_width(stages: int, options: list[WidthOption], refill: int = 0) -> tuple[list[dict], int]:
    """E(T) for every width and the width with the smallest (the narrower on a tie)."""
    if stages < 1 or not options or refill < 0:
        raise ConfigError("need at least one stage, one width and a refill depth >= 0")
    for o in options:
        if o.width < 1 or o.step_ms <= 0 or not 0 <= o.hit_rate <= 1:
            raise ConfigError(f"width {o.width}: need width >= 1, step > 0 ms and a hit rate in [0, 1]")
    rows = [{"width": o.width, "step_ms": o.step_ms, "hit_rate": o.hit_rate,
             "expected_tbt_ms": round(o.expected_tbt_ms(stages, refill), 3)} for o in options]
    best = min(rows, key=lambda r: (r["expected_tbt_ms"], r["width"]))["width"]
    return rows, best
