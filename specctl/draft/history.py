"""What the draft server's speculation cache keeps per session and counts overall."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

PRIOR_BACKUP_LENGTH = 1.2  # tokens per round the n-gram backup is assumed to give before it is measured


@dataclass(slots=True)
class History:
    """What a session's past rounds say about its next outcome."""
    ranks: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))
    proposed_at: float | None = None
    return_s: float | None = None  # draft-side return time Z (proposal sent -> next outcome), smoothed
    backup_pending: bool = False  # its last proposal came from the n-gram backup
    backup_rounds: int = 0
    backup_accepted: int = 0
    last_outcome_at: float | None = None
    planned_last: bool = False  # its last proposal was pre-speculated
    level_last: int = 0  # the load level whose trial its last proposal counts for (0: none)

    @property
    def backup_length(self) -> float:
        return 1 + self.backup_accepted / self.backup_rounds if self.backup_rounds else PRIOR_BACKUP_LENGTH


@dataclass(slots=True)
class PrespecStats:
    hits: int = 0
    partial_hits: int = 0  # hits whose branch was still being drafted
    short_answers: int = 0  # partial hits answered at once with the tokens drafted so far
    early_answers: int = 0  # hits answered by the event loop, not behind a background step (early.py)
    hit_drafted: float = 0.0  # the hits' drafted shares summed (a finished branch counts 1)
    misses: int = 0
    branches_drafted: int = 0  # branches that got at least one draft forward
    branches_used: int = 0
    steps: int = 0
    busy_s: float = 0.0
    fallback_jit: int = 0
    jit_carried: int = 0  # of those, drafted as branches in forwards carrying the other plans
    fallback_ngram: int = 0
    skipped: int = 0  # rounds not pre-speculated (a trial without it, or it did not pay)
