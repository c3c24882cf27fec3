"""How the draft server drafts the sessions whose outcome missed (DESIGN §4): just in time on
the draft model, or the n-gram backup, by the measured per-token drafting times against the
sessions' return times. A mixin of ``SpeculationCache`` (it reads the cache's config, depth
and histories, and keeps ``step_s``: the smoothed time per token by sessions drafted together)."""

from __future__ import annotations

from specctl.draft.fanout import choose_fallback
from specctl.spec.draft_state import DraftState


class MissFallback:
    def fallback_for(self, misses: list[tuple[int, DraftState]]) -> str:
        """How to draft the sessions that just missed, together: "jit" or "ngram" (``auto``: by the
        measured times; just in time when not adaptive, as every timed choice here: tests decide)."""
        if self.config.fallback != "auto":
            return self.config.fallback
        if not self.config.adaptive:
            return "jit"
        returns = [self.history[tag].return_s for tag, _ in misses if self.history.get(tag) and self.history[tag].return_s]
        if not returns:
            return "jit"
        primary = sum(1 + s.accepted / s.rounds if s.rounds else 1.0 for _, s in misses) / len(misses)
        backup = sum(self.history[tag].backup_length for tag, _ in misses) / len(misses)
        known = sorted(self.step_s, key=lambda m: abs(m - len(misses)))
        step_s = self.step_s[known[0]] if known else 0.0
        return choose_fallback(len(misses), step_s, self.depth, sum(returns) / len(returns), primary, backup)

    def drafted(self, sessions: int, seconds: float) -> None:
        """A just-in-time pass drafted ``sessions`` chains in ``seconds``."""
        per_token = seconds / self.depth
        old = self.step_s.get(sessions)
        self.step_s[sessions] = per_token if old is None else 0.8 * old + 0.2 * per_token
