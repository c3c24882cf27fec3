"""The spread every benchmark here reports beside a figure: min / median / max over runs or prompts."""

from __future__ import annotations

import statistics


def spread(values: list[float], digits: int | None = None) -> dict:
    """{"min", "median", "max"} of ``values``, rounded to ``digits`` if given."""
    stats = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    return stats if digits is None else {key: round(value, digits) for key, value in stats.items()}
