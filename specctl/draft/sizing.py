"""How big a session's pre-speculation plan is (DESIGN §4): the fan-out over its proposal's
outcomes from the session's acceptance and power-law exponent, the budget the measured times
say pays, and Saguaro's reshaping of a sampled chain for that fan-out. A mixin of
``SpeculationCache`` (it reads the cache's config, histories, plans and step samples)."""

from __future__ import annotations

from functools import partial

from specctl.draft.fanout import (
    MIN_OUTCOMES_FOR_FIT, acceptance_by_position, acceptance_estimate, budget_that_fits, budget_that_pays,
    chain_outcome_probs, expected_hit, fanout_for, hit_curve, power_law_exponent, step_time_fit, tree_outcome_probs,
)
from specctl.draft.history import History
from specctl.spec.draft_state import DraftState
from specctl.spec.drafters import RANKED, Proposal, tree_shape
from specctl.spec.sampling import saguaro


class PlanSizing:
    def reshape_for(self, tag: int, state: DraftState):
        """Saguaro sampling for a session's next chain proposal (None: plain sampling; a tree's
        candidates are not sampled, so there is nothing to reshape)."""
        if state.params.greedy or self.config.saguaro_c >= 1.0 or tree_shape(state.session) is not None:
            return None
        history = self.history.setdefault(tag, History())
        outcomes = chain_outcome_probs(acceptance_of(state, self.depth))
        r = power_law_exponent(history.ranks, RANKED - 1)
        counts = fanout_for(outcomes, r, self.budget_for(history, outcomes, r), RANKED - 1)
        return partial(_saguaro_at, counts, self.config.saguaro_c)

    def _fanout_tree(self, tag: int, state: DraftState, proposal: Proposal) -> list[int]:
        """F_v for each node of the proposal, from the session's acceptance (by position for a
        chain, the rate for a tree's nodes) and exponent."""
        history = self.history.setdefault(tag, History())
        tree = proposal.tree
        if int(tree.max_depth) == len(tree) - 1:  # a chain: its outcomes from the acceptance by position
            outcomes = chain_outcome_probs(acceptance_of(state, len(tree) - 1))
        else:
            outcomes = tree_outcome_probs(acceptance_estimate(state.accepted, state.drafted), tree.parents.tolist(),
                                          tree.probs.tolist())
        r = power_law_exponent(history.ranks, RANKED - 1)
        return fanout_for(outcomes, r, self.budget_for(history, outcomes, r), RANKED - 1)

    def budget_for(self, history: History, outcomes: list[float], r: float) -> int:
        """The configured budget until the return and step times are measured; then the budget
        whose expected hits save the most drafting time (partly drafted hits too), from the
        session's ranked bonuses or, while it has few, every session's; before any are ranked,
        what the draft finishes before the outcome returns."""
        fit = step_time_fit(self.step_samples)
        if not self.config.adaptive or history.return_s is None or fit is None:
            return self.config.budget
        sharing = len(self.plans) + 1
        ranks = history.ranks if len(history.ranks) >= MIN_OUTCOMES_FOR_FIT else self.ranks
        if len(ranks) < MIN_OUTCOMES_FOR_FIT:
            return budget_that_fits(history.return_s, self.depth, fit, sharing, self.config.budget, self.width)
        hit = hit_curve(ranks)

        def hit_at(budget: int) -> float:
            return expected_hit(outcomes, fanout_for(outcomes, r, budget, RANKED - 1), hit)

        return budget_that_pays(history.return_s, self.depth, fit, sharing, self.config.budget, hit_at, self.width)


def acceptance_of(state: DraftState, depth: int) -> list[float]:
    """The session's acceptance by position 1..depth (per level for a tree), from its rounds."""
    return acceptance_by_position(state.outcomes, depth, acceptance_estimate(state.accepted, state.drafted))


def _saguaro_at(counts: list[int], c: float, position: int, q):
    return saguaro(q, counts[min(position, len(counts) - 1)], c)
