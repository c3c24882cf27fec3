"""Pre-speculation's settings (``specctl draft --prespec``): checked when made, and light to
import, so the command line refuses a bad flag before any model or torch loads."""

from __future__ import annotations

from dataclasses import dataclass

from specctl.errors import ConfigError

FALLBACKS = ("auto", "jit", "ngram")


@dataclass(slots=True)
class PrespecConfig:
    budget: int = 8  # most branches per session and round
    saguaro_c: float = 1.0  # Saguaro sampling's down-weighting constant (1 = plain sampling)
    fallback: str = "auto"  # on a miss: auto | jit | ngram
    max_rows: int = 64  # most branch tokens in one background forward (bounds a real request's wait)
    # Measured times steer it: the budget is cut to what finishes within the return time, and
    # trials keep pre-speculation only while it makes rounds faster (draft/trial.py). Off: tests decide.
    adaptive: bool = True
    trials: bool = True  # with adaptive: off = pre-speculate every round (measure it alone)

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or not 1 <= self.budget <= 4096:
            raise ConfigError(f"the pre-speculation budget must be an integer in [1, 4096], got {self.budget!r}")
        if not isinstance(self.saguaro_c, (int, float)) or not 0.0 < self.saguaro_c <= 1.0:
            raise ConfigError(f"--saguaro-c must be in (0, 1], got {self.saguaro_c!r}")
        if self.fallback not in FALLBACKS:
            raise ConfigError(f"--fallback must be one of {', '.join(FALLBACKS)}, got {self.fallback!r}")
        if not isinstance(self.max_rows, int) or self.max_rows < 1:
            raise ConfigError(f"max_rows must be a positive integer, got {self.max_rows!r}")
