"""Per-tag draft state. Touched only on the compute thread, so no locks: the asyncio side
checks ownership (a connection can only touch its own tags) before submitting work. One
exception, ``early_answer``: the event loop reads a session's text and outstanding proposal
(changed only by that session's own requests, which the server runs one at a time) and the
branches the compute thread published (draft/early.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from specctl.draft.early import Ticket, commit, pick, proposal_for
from specctl.draft.speculation import SpeculationCache
from specctl.engine.kv_cache import KVPool
from specctl.errors import PromptTooLong, SpecctlError
from specctl.engine.spec import check_token_ids
from specctl.net.protocol import DraftRules, OpenSession, Proposal, SparseProbs
from specctl.spec.draft_state import DraftState, draft_capacity, draft_many
from specctl.engine.tree import TokenTree
from specctl.spec.batch_drafting import prefill_step
from specctl.spec.drafters import Drafter, NgramDrafter, Proposal as DraftProposal, _ModelDraftSession, first_levels
from specctl.spec.params import SamplingParams


class UnknownTag(Exception):
    pass


@dataclass(slots=True)
class SessionTable:
    drafter: Drafter
    pool: KVPool
    vocab_size: int
    max_context: int
    states: dict[int, DraftState] = field(default_factory=dict)
    total_rounds: int = 0
    total_drafted: int = 0
    total_accepted: int = 0
    speculation: SpeculationCache | None = None  # pre-speculation, when on (model drafters)
    # (request's parameters, prompt, output so far) -> the logit rules and grammar a model drafter
    # follows (spec.logit_rules), or None when it cannot
    guide_of: Callable[[SamplingParams, list[int], list[int]], Any] | None = None

    def open(self, tag: int, msg: OpenSession) -> None:
        params = SamplingParams(temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k, max_tokens=msg.max_tokens,
                                min_p=msg.min_p, sampler_order=tuple(msg.sampler_order), cache_salt=msg.cache_salt)
        check_token_ids(msg.prompt, self.vocab_size)
        if not msg.prompt or len(msg.prompt) + msg.max_tokens > self.max_context:
            raise PromptTooLong(f"prompt of {len(msg.prompt)} tokens plus max_tokens {msg.max_tokens} does not fit the draft's context of {self.max_context}")
        capacity = draft_capacity(len(msg.prompt), msg.max_tokens, self.drafter.max_nodes)
        capacity += self.speculation.reserve if self.speculation is not None else 0
        session = self.drafter.open(capacity, self.pool)
        generator = torch.Generator().manual_seed(msg.seed)
        self.states[tag] = DraftState(session, params, generator, list(msg.prompt), capacity, self.drafter.max_nodes,
                                      self.vocab_size, reproducible=msg.reproducible)
        if self.guide_of is not None and hasattr(session, "guide"):
            rules = wire_rules(msg, msg.max_tokens + msg.generated)
            if rules is not None:
                split = len(msg.prompt) - msg.generated
                session.guide = self.guide_of(rules, list(msg.prompt[:split]), list(msg.prompt[split:]))

    def prompt_to_feed(self, tag: int) -> list[int] | None:
        """The prompt ``prefill_step`` feeds in chunks before the first proposal, which the
        prefill gate may share with sessions that start alike; None when there is none (a lookup
        drafter, a prompt within a chunk, chunks off) or it restores nothing (a reproducible one)."""
        state = self.states.get(tag)
        session = getattr(state, "session", None)
        if not isinstance(session, _ModelDraftSession) or state.rounds or state.reproducible:
            return None
        chunk = session.decoder.prefill_chunk
        return state.seq if 0 < chunk < len(state.seq) else None

    def cache_salt(self, tag: int) -> str:
        """The session's prefix-cache namespace (the prefill gate shares prefills within it)."""
        state = self.states.get(tag)
        return state.params.cache_salt if state is not None else ""

    def prefill_step(self, tag: int) -> bool:
        """A chunk of a new model-draft session's prompt into its cache (batch_drafting.prefill_step);
        True once it is in, or when there is nothing to feed (closed, a lookup drafter, drafted already)."""
        state = self.states.get(tag)
        session = getattr(state, "session", None)
        if state is None or not isinstance(session, _ModelDraftSession) or state.rounds:
            return True
        return prefill_step(session, state.seq)

    def propose_many(self, requests: list[tuple]) -> list:
        """Serve many Propose requests (tag, path, tokens[, max_depth: 0 when left out]) in one
        pass (``draft_many``): one Proposal message or exception each. An outcome that does not
        fit its session is refused before drafting."""
        results: list = [None] * len(requests)
        ready: list[tuple[int, int, DraftState]] = []
        for i, (tag, path, tokens, *max_depth) in enumerate(requests):
            try:
                state = self.states.get(tag)
                if state is None:
                    raise UnknownTag(tag)
                before = state.rounds, state.drafted, state.accepted
                state.cap_depth(max_depth[0] if max_depth else 0)  # a bad one refused before the outcome is applied
                if self._speculates(state):  # learn from the outcome; no branch KV may stay
                    self.speculation.outcome_without_lookup(tag, path, tokens)
                state.advance(path, tokens)
            except Exception as exc:  # noqa: BLE001 - reported to that request only
                results[i] = exc
                continue
            self._count(state, before)
            ready.append((i, tag, state))
        spec = self.speculation
        if spec is not None:
            ready = self._fall_back(ready, results)
            for _, tag, state in ready:
                state.session.reshape = spec.reshape_for(tag, state) if self._speculates(state) else None
        started = time.perf_counter()
        proposals = draft_many([state for _, _, state in ready])
        if spec is not None and ready:
            spec.drafted(len(ready), time.perf_counter() - started)
        for (i, tag, state), proposal in zip(ready, proposals):
            if isinstance(proposal, Exception):
                results[i] = proposal
                continue
            results[i] = _message(tag, proposal)
            if self._speculates(state):
                spec.planned(tag, state, proposal)
        return results

    def _speculates(self, state: DraftState | None) -> bool:
        """Pre-speculation is on and may serve this session: never a reproducible one, whose
        proposals would then depend on the leftover capacity (DraftState.reproducible)."""
        return self.speculation is not None and not getattr(state, "reproducible", False)

    def _fall_back(self, ready: list, results: list) -> list:
        """The sessions whose outcome missed the speculation cache are drafted just in time with
        the others, or answered from the n-gram backup (Saguaro fallback); the rest of ``ready``."""
        spec = self.speculation
        missed = [(i, tag, state) for i, tag, state in ready if tag in spec.missed]
        spec.missed.difference_update(tag for _, tag, _ in missed)
        if not missed:
            return ready
        if spec.fallback_for([(tag, state) for _, tag, state in missed]) == "jit":
            spec.stats.fallback_jit += len(missed)
            return ready
        spec.stats.fallback_ngram += len(missed)
        backup = NgramDrafter(spec.depth)
        for i, tag, state in missed:
            proposal = DraftProposal(TokenTree.chain(state.seq[-1],
                                                     backup.lookup(state.seq, getattr(state.session, "depth_cap", 0))))
            state.session.holds_text_only()  # none of this proposal's nodes is in the draft's KV
            results[i] = _message(tag, state.proposed(proposal))
            spec.planned(tag, state, proposal, backup=True)
        backed = {tag for _, tag, _ in missed}
        return [item for item in ready if item[1] not in backed]

    def lookup_many(self, requests: list[tuple]) -> list:
        """Answer Propose requests (tag, path, tokens[, max_depth]) from the speculation cache: a
        Proposal message per hit, cut to its max_depth; None per miss (then ``propose_many``
        serves it; always a reproducible session's, and one with a bad max_depth, refused there)."""
        asked = [(i, (tag, state, path, tokens)) for i, (tag, path, tokens, *max_depth) in enumerate(requests)
                 if (state := self.states.get(tag)) is None
                 or (self._speculates(state) and _capped(state, max_depth[0] if max_depth else 0))]
        items = [item for _, item in asked]
        before = {tag: (s.rounds, s.drafted, s.accepted) for tag, s, _, _ in items if s is not None}
        results: list = [None] * len(requests)
        for (i, (tag, state, _, _)), proposal in zip(asked, self.speculation.lookup_many(items)):
            if proposal is not None:
                self._count(state, before[tag])
                results[i] = _message(tag, proposal)
                self.speculation.planned(tag, state, proposal)
        return results

    def early_answer(self, tag: int, path: list[int], tokens: list[int],
                     max_depth: int = 0) -> tuple[Proposal, Ticket] | None:
        """On the event loop: the Proposal message for this outcome from a published branch (its
        first ``max_depth`` levels), and the ticket the compute thread commits it with
        (``commit_many``); None: go through the compute thread (a miss, a branch not far enough,
        a bad outcome or max_depth to report)."""
        spec, state = self.speculation, self.states.get(tag)
        published = spec.published.get(tag) if spec is not None and state is not None else None
        if published is None or max_depth < 0:
            return None
        try:
            state.check_outcome(path, tokens)
        except Exception:  # noqa: BLE001 - the compute thread's path reports it
            return None
        picked = pick(published, path, tokens)
        if picked is None:
            return None
        key, branch = picked
        message = _message(tag, first_levels(proposal_for(branch, state.params.greedy), max_depth))
        return message, Ticket(tag, list(path), list(tokens), key, branch.drafted, published.plan, time.perf_counter(),
                               max_depth)

    def commit_many(self, tickets: list[Ticket]) -> list:
        """On the compute thread: make each answered branch its session's and plan the next
        round (None each, or the exception; a session that fails here is closed, so its next
        request is refused with a clear error rather than drafted from a broken KV)."""
        results: list = []
        for ticket in tickets:
            state = self.states.get(ticket.tag)
            if state is None:  # closed while the answer was out
                results.append(UnknownTag(ticket.tag))
                continue
            before = state.rounds, state.drafted, state.accepted
            try:
                state.cap_depth(ticket.max_depth)  # what the answer sent kept to
                proposal = commit(self.speculation, state, ticket)
            except Exception as exc:  # noqa: BLE001 - reported to that request only
                self.close(ticket.tag)
                results.append(exc)
                continue
            self._count(state, before)
            self.speculation.planned(ticket.tag, state, proposal, proposed_at=ticket.answered_at)
            results.append(None)
        return results

    def _count(self, state: DraftState, before: tuple[int, int, int]) -> None:
        self.total_rounds += state.rounds - before[0]
        self.total_drafted += state.drafted - before[1]
        self.total_accepted += state.accepted - before[2]

    def close(self, tag: int, tail: Sequence[int] = ()) -> None:
        """Frees a session's state, then forgets it: the stats feed (read from the event loop
        while this runs on the compute thread) never counts a session gone whose KV is held.
        ``tail``: the text committed after its last proposal, which its drafter may learn from
        (up to the positions the session reserved)."""
        state = self.states.get(tag)
        try:
            if self.speculation is not None:
                self.speculation.drop(tag)
            if state is not None:
                try:
                    if tail and len(state.seq) + len(tail) <= state.capacity:
                        state.session.observe(state.seq + list(tail))
                finally:
                    state.close()
        finally:
            self.states.pop(tag, None)

    def snapshot(self) -> dict:
        per_session = {
            str(tag): {
                "rounds": s.rounds,
                "acceptance_rate": round(s.accepted / s.drafted, 4) if s.drafted else 0.0,
                "mean_accepted_length": round(1 + s.accepted / s.rounds, 4) if s.rounds else 0.0,
            }
            for tag, s in list(self.states.items())
        }
        return {
            "sessions": len(self.states),
            "rounds": self.total_rounds,
            "acceptance_rate": round(self.total_accepted / self.total_drafted, 4) if self.total_drafted else 0.0,
            "mean_accepted_length": round(1 + self.total_accepted / self.total_rounds, 4) if self.total_rounds else 0.0,
            "kv_used_mb": round(self.pool.used_bytes / 2**20, 2),
            "per_session": per_session,
            **({"prespec": self.speculation.snapshot()} if self.speculation is not None else {}),
        }


def _message(tag: int, proposal: DraftProposal) -> Proposal:
    tree = proposal.tree
    q = None if proposal.draft_probs is None else SparseProbs.from_dense(proposal.draft_probs)
    return Proposal(tag, tree.tokens.tolist(), tree.parents.tolist(), q,
                    Proposal.pack_confidences(tree.probs[1:].tolist()))


def wire_rules(msg: DraftRules, max_tokens: int) -> SamplingParams | None:
    """The request's logit rules and grammar as an opening message carries them, or None when
    there are none (or they do not hold together: the draft then drafts free, which the
    target's check of the same request makes rare)."""
    try:
        rules = SamplingParams(
            max_tokens=max(max_tokens, msg.min_tokens, 1), presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty, repetition_penalty=msg.repetition_penalty,
            penalty_last_n=msg.penalty_last_n, allowed_token_ids=tuple(msg.allowed_token_ids),
            min_tokens=msg.min_tokens, logit_bias=tuple(sorted(msg.logit_bias.items())),
            bad_words=tuple(map(tuple, msg.bad_words)), structured=(msg.structured_kind, msg.structured_spec) if msg.structured_kind else None,
            thinking_budget=None if msg.thinking_budget < 0 else msg.thinking_budget,
            thinking_markers=(tuple(msg.thinking_start), tuple(msg.thinking_end)) if msg.thinking_budget >= 0 else ())
    except SpecctlError:
        return None
    return rules if rules.adjusts_logits else None


def _capped(state: DraftState, max_depth: int) -> bool:
    """The session's next proposal kept to ``max_depth`` (the target's load); False for a bad one."""
    try:
        state.cap_depth(max_depth)
    except SpecctlError:
        return False
    return True
