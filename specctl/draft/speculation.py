"""The draft server's speculation cache: one pre-speculation Plan per session whose proposal
(a chain or a tree) is out, keyed (tag, node, bonus) through the plan's branches (for a
chain the node is k, the number of tokens accepted). Touched only on the
compute thread.

- ``planned``: after a proposal is sent, plan its outcomes' branches (fan-out from the
  session's own acceptance rate and power-law exponent) and wake the background work;
- ``step``: one batched forward over every plan's live branches, run by the compute
  thread only while no real request is queued (leftover capacity);
- ``lookup_many``: a Propose whose outcome a branch holds is answered from it (finishing
  the branch first when it is not done, or, when the measured times say waiting does not
  pay, with the tokens or levels it has); anything else is a miss, which the table drafts
  just in time or with the n-gram backup (``fallback_for``), per session: a miss never
  holds back another session's hit. Where rows cost little (a GPU-like draft), a miss is
  drafted as a branch of its own, and a hit's unfinished branch finished, in forwards that
  carry the other sessions' plans too (``_finish``), so a miss does not starve them."""

from __future__ import annotations

import collections
import time

from specctl.draft.fallback import MissFallback
from specctl.draft.fanout import answer_now, carry_is_cheap, step_time_fit
from specctl.draft.prespec_config import FALLBACKS, PrespecConfig  # noqa: F401 - re-exported
from specctl.draft.early import Published, publish
from specctl.draft.history import History, PrespecStats
from specctl.draft.branches import Branch, kv_per_branch
from specctl.draft.prespec import Plan, adopt, discard, live_rows, make_plan, proposal_of, step
from specctl.draft.sizing import PlanSizing, acceptance_of
from specctl.draft.trial import Trials
from specctl.spec.draft_state import DraftState
from specctl.spec.drafters import Drafter, ModelTreeDrafter, Proposal


def _end_node(path: list[int]) -> int:
    """The proposal node the accepted path ends at (0: the root, nothing accepted)."""
    return path[-1] if path else 0


class SpeculationCache(PlanSizing, MissFallback):
    def __init__(self, config: PrespecConfig, depth: int, wake=lambda: None, shape: ModelTreeDrafter | None = None) -> None:
        """``shape``: the tree drafter whose trees the branches are; None: chains."""
        self.config, self.depth, self.wake, self.shape = config, depth, wake, shape
        self.width = 1 if shape is None else shape.width  # a chain is a tree of width 1
        self.plans: dict[int, Plan] = {}
        self.history: dict[int, History] = {}
        self.missed: set[int] = set()  # sessions whose outcome just missed (their fallback is due)
        self.step_s: dict[int, float] = {}  # smoothed chain-drafting time per token, by sessions drafted together
        self.step_samples: collections.deque = collections.deque(maxlen=64)  # (rows, seconds) of background steps
        # Every session's bonus ranks: the draft/target pair's own, so a session's budget can use
        # them until it has ranked enough of its own.
        self.ranks: collections.deque = collections.deque(maxlen=1024)
        self.trials = Trials()
        self.stats = PrespecStats()
        # Per session, its plan's branches as last published: the one thing the event loop reads
        # (each entry replaced whole; see early.py).
        self.published: dict[int, Published] = {}

    @classmethod
    def for_drafter(cls, config: PrespecConfig, drafter: Drafter, wake=lambda: None) -> "SpeculationCache":
        return cls(config, drafter.depth, wake, drafter if isinstance(drafter, ModelTreeDrafter) else None)

    @property
    def reserve(self) -> int:
        """KV positions a session needs beyond its proposals for its branches (and the tails:
        the proposal's last level, fed for the candidates after it)."""
        return self.width + self.config.budget * kv_per_branch(self.shape, self.depth)

    def planned(self, tag: int, state: DraftState, proposal: Proposal, backup: bool = False,
                proposed_at: float | None = None) -> None:
        """A proposal went out (at ``proposed_at``, default now): plan its outcomes' branches
        (not for a backup proposal)."""
        history = self.history.setdefault(tag, History())
        history.proposed_at = time.perf_counter() if proposed_at is None else proposed_at
        history.backup_pending = backup
        history.planned_last, history.level_last = False, 0
        old = self._take_plan(tag)
        if old is not None:
            discard(old)
        if backup or proposal.ranked is None or not self._pays(history):
            return
        cap = getattr(state.session, "depth_cap", 0)  # branches no deeper than the target asks for now
        plan = make_plan(state, proposal, self._fanout_tree(tag, state, proposal), min(cap or self.depth, self.depth),
                         self.reshape_for(tag, state))
        if plan is not None:
            self.plans[tag] = plan
            history.planned_last = True
            self.wake()

    def _pays(self, history: History) -> bool:
        """Pre-speculate the round being proposed? Always when not adaptive; else as the trial
        of the present load says."""
        if not (self.config.adaptive and self.config.trials):
            return True
        on, history.level_last = self.trials.next_round(len(self.history))
        self.stats.skipped += not on
        return on

    def outcome(self, tag: int, path: list[int], tokens: list[int]) -> Plan | None:
        """The outcome of the session's last proposal arrived: learn from it; its plan, if any."""
        history = self.history.setdefault(tag, History())
        if history.proposed_at is not None:
            now = time.perf_counter()
            z = now - history.proposed_at
            history.return_s = z if history.return_s is None else 0.8 * history.return_s + 0.2 * z
            history.proposed_at = None
            if history.last_outcome_at is not None:  # a whole round: outcome to outcome
                self.trials.record(history.level_last, history.planned_last, len(tokens), now - history.last_outcome_at)
            history.last_outcome_at = now
        if history.backup_pending:
            history.backup_pending = False
            history.backup_rounds += 1
            history.backup_accepted += len(path)
        plan = self._take_plan(tag)
        # Ranked whenever the candidates after the end node are known: a full accept's (a
        # last-level node's) once its tail was fed — the likeliest outcome of a tree or a deep
        # chain, which the hit curve would otherwise never see.
        if plan is not None and len(tokens) == len(path) + 1 and plan.candidates_after(_end_node(path)) is not None:
            rank = plan.rank_of(_end_node(path), tokens[-1])
            history.ranks.append(rank)
            self.ranks.append(rank)
        return plan

    def outcome_without_lookup(self, tag: int, path: list[int], tokens: list[int]) -> None:
        """An outcome served by drafting: learn from it (a second call for the same outcome
        learns nothing twice) and drop any plan it still had, with its branches' KV."""
        plan = self.outcome(tag, path, tokens)
        if plan is not None:
            discard(plan)

    def lookup_many(self, requests: list[tuple[int, DraftState | None, list[int], list[int]]]) -> list[Proposal | None]:
        """Per request (tag, state, path, tokens): the proposal a branch holds for it, or None
        (a miss, or nothing was planned: the caller drafts as usual)."""
        results: list[Proposal | None] = [None] * len(requests)
        adopted: list[tuple[int, int, DraftState, Plan]] = []
        for i, (tag, state, path, tokens) in enumerate(requests):
            plan = self.outcome(tag, path, tokens) if state is not None else self._take_plan(tag)
            if plan is None or state is None:
                continue
            try:
                state.check_outcome(path, tokens)
            except Exception:  # noqa: BLE001 - the table's own drafting path reports it
                discard(plan)
                continue
            # A branch drafted on text + path + bonus; an outcome that committed more (fused
            # drafters, skipped rounds) is a miss whatever its last token.
            key = (_end_node(path), tokens[-1])
            branch = plan.branches.get(key) if len(tokens) == len(path) + 1 else None
            if branch is None or not branch.slots:
                self.stats.misses += 1
                # A branch planned but not started is a miss like one never planned: carried in
                # the other plans' forwards only where that is cheap, else the session's fallback.
                carried = len(tokens) == len(path) + 1 and self._carry_a_miss()
                branch = (branch or plan.open_outcome(*key)) if carried else None
                if branch is None:
                    discard(plan)
                    self.missed.add(tag)
                    continue
                # drafted just in time, in forwards that carry the other plans' branches (_finish)
                self.stats.fallback_jit += 1
                self.stats.jit_carried += 1
                adopt(plan, key)
                state.advance(path, tokens, kv_done=True)
                adopted.append((i, tag, state, plan))
                continue
            short = self._answers_now(tag, state, branch, plan)
            self.stats.hits += 1
            self.stats.partial_hits += branch.live(plan.depth)
            # ready: what a hit needs no more drafting for (a short answer's proposal is all drafted)
            self.stats.hit_drafted += 1.0 if short else branch.drafted(plan.depth)
            self.stats.branches_used += 1
            adopt(plan, key)
            if short:
                plan.depth = branch.levels  # its proposal: what it has drafted so far
                self.stats.short_answers += 1
            state.advance(path, tokens, kv_done=True)
            adopted.append((i, tag, state, plan))
        self._finish([plan for _, _, _, plan in adopted])
        for i, tag, state, plan in adopted:
            results[i] = state.proposed_within_cap(proposal_of(plan))  # the target's cap may have come since
        return results

    def _answers_now(self, tag: int, state: DraftState, branch: Branch, plan: Plan) -> bool:
        """Answer an adopted branch that is still being drafted with what it has? By the measured
        return and one-row step times (never without them, nor when not adaptive). A tree's
        levels count as a chain's tokens: its acceptance rate is the session's per level."""
        if not branch.live(plan.depth) or branch.levels < 1:
            return False
        return_s, step_s = self._answer_times(tag)
        if return_s is None or step_s is None:
            return False
        return answer_now(branch.levels, plan.depth, acceptance_of(state, plan.depth), return_s, step_s)

    def _answer_times(self, tag: int) -> tuple[float | None, float | None]:
        """The session's return time and a one-row step's, as measured (None: not yet, or not adaptive)."""
        history, fit = self.history.get(tag), step_time_fit(self.step_samples)
        if not self.config.adaptive or history is None or fit is None:
            return None, None
        return history.return_s, fit[0] + fit[1]

    def step(self) -> bool:
        """One background forward over the live branches; False when there was nothing to do."""
        due = [plan for plan in self.plans.values() if plan.has_work]
        if not due:
            return False
        rows = {id(plan): live_rows(plan) for plan in due}
        started = time.perf_counter()
        advanced = self._advance(due)
        seconds = time.perf_counter() - started
        self.step_samples.append((sum(rows[key] for key in advanced), seconds))
        self.stats.steps += 1
        self.stats.busy_s += seconds
        return True

    def _advance(self, plans: list[Plan]) -> set[int]:
        """One forward over ``plans``' live rows (the first ones first, when max_rows cuts); the
        ids of the plans it advanced. The cache's plans just served go to the back (a step that
        cannot take all serves them in turn) and publish their finished branches (early.py)."""
        advanced = {id(plan) for plan in step(plans, self.config.max_rows)}
        for tag, plan in list(self.plans.items()):
            if id(plan) in advanced:
                self.plans[tag] = self.plans.pop(tag)
                self.published[tag] = publish(plan)
        return advanced

    def _carry_a_miss(self) -> bool:
        """Draft a miss as a branch in forwards that carry the other plans (rather than just in
        time on its own)? Only with the just-in-time fallback, other plans at work, and rows
        that cost little (``carry_is_cheap``)."""
        if self.config.fallback == "ngram":
            return False
        return self._carry_is_cheap(1, sum(live_rows(plan) for plan in self.plans.values() if plan.has_work))

    def _carry_is_cheap(self, own_rows: int, carried_rows: int) -> bool:
        """By the measured step times (never when not adaptive: tests decide)."""
        return self.config.adaptive and carry_is_cheap(step_time_fit(self.step_samples), own_rows, carried_rows)

    def _finish(self, adopted: list[Plan]) -> None:
        """Draft the adopted branches to full depth (a hit that came before they were done, a
        carried miss); each forward carries the other plans' live rows where they cost little."""
        while any(plan.has_work for plan in adopted):
            own = [plan for plan in adopted if plan.has_work]
            others = [plan for plan in self.plans.values() if plan.has_work]
            carried = others if self._carry_is_cheap(sum(map(live_rows, own)), sum(map(live_rows, others))) else []
            if carried:
                self._advance(own + carried)
            else:
                step(own)

    def _budget_now(self) -> float:
        """Mean budget the open plans were given (what fits the measured times)."""
        plans = list(self.plans.values())
        return round(sum(sum(p.fanout) for p in plans) / len(plans), 2) if plans else float(self.config.budget)

    def _take_plan(self, tag: int) -> Plan | None:
        """The session's plan leaves the cache (its outcome arrived, or its session ended), and
        with it what was published of it: count its work."""
        self.published.pop(tag, None)
        plan = self.plans.pop(tag, None)
        if plan is not None:
            self.stats.branches_drafted += plan.started
        return plan

    def drop(self, tag: int) -> None:
        self._take_plan(tag)
        self.history.pop(tag, None)
        self.missed.discard(tag)

    def snapshot(self) -> dict:
        s = self.stats
        looked = s.hits + s.misses
        return {"hits": s.hits, "partial_hits": s.partial_hits, "short_answers": s.short_answers,
                "early_answers": s.early_answers, "misses": s.misses,
                "hit_rate": round(s.hits / looked, 4) if looked else 0.0,
                # what SSD's model calls the hit rate: a partial hit leaves the rest to draft
                "hit_drafted": round(s.hit_drafted, 4),
                "ready_rate": round(s.hit_drafted / looked, 4) if looked else 0.0,
                "branches_drafted": s.branches_drafted, "branches_used": s.branches_used, "steps": s.steps,
                "busy_s": round(s.busy_s, 6), "fallback_jit": s.fallback_jit, "jit_carried": s.jit_carried, "fallback_ngram": s.fallback_ngram, "skipped": s.skipped,
                "trials": self.trials.snapshot(),
                "plans": len(self.plans), "budget": self.config.budget, "budget_now": self._budget_now(), "saguaro_c": self.config.saguaro_c,
                "fallback": self.config.fallback}
