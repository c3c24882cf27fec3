"""Per-tag draft state. Touched only on the compute thread, so no locks: the asyncio side
checks ownership (a connection can only touch its own tags) before submitting work."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specctl.engine.kv_cache import KVPool
from specctl.errors import BadRequest, PromptTooLong
from specctl.net.protocol import OpenSession, Proposal, Tensor
from specctl.spec.drafters import DraftSession, Drafter, batch_kind
from specctl.spec.sampling import SamplingParams


class UnknownTag(Exception):
    pass


@dataclass(slots=True)
class TagState:
    session: DraftSession
    params: SamplingParams
    generator: torch.Generator
    seq: list[int]
    capacity: int
    proposed: bool = False
    last_depth: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise BadRequest(f"token ids must be in [0, {vocab_size}), got {min(ids)}..{max(ids)}")


@dataclass(slots=True)
class SessionTable:
    drafter: Drafter
    pool: KVPool
    vocab_size: int
    max_context: int
    states: dict[int, TagState] = field(default_factory=dict)
    total_rounds: int = 0
    total_drafted: int = 0
    total_accepted: int = 0

    def open(self, tag: int, msg: OpenSession) -> None:
        params = SamplingParams(temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k, max_tokens=msg.max_tokens)
        check_token_ids(msg.prompt, self.vocab_size)
        if not msg.prompt or len(msg.prompt) + msg.max_tokens > self.max_context:
            raise PromptTooLong(f"prompt of {len(msg.prompt)} tokens plus max_tokens {msg.max_tokens} does not fit the draft's context of {self.max_context}")
        capacity = len(msg.prompt) + msg.max_tokens + 2 * self.drafter.max_nodes + 2
        session = self.drafter.open(msg.prompt, capacity, self.pool)
        generator = torch.Generator().manual_seed(msg.seed)
        self.states[tag] = TagState(session, params, generator, list(msg.prompt), capacity)

    def propose_many(self, requests: list[tuple[int, list[int], list[int]]]) -> list:
        """Serve many Propose requests in one pass: chain sessions are drafted together and
        tree sessions together (one forward per step or level for all); anything else one at
        a time. One result or exception each."""
        results: list = [None] * len(requests)
        groups: dict = {}
        for i, (tag, path, tokens) in enumerate(requests):
            try:
                state = self._advance(tag, path, tokens)
            except Exception as exc:  # noqa: BLE001 - reported to that request only
                results[i] = exc
                continue
            together = batch_kind(state.session)  # the server allows one request in flight per tag
            if together is None:
                results[i] = self._draft(tag, state)
            else:
                groups.setdefault(together, []).append((i, state))
        for together, batch in groups.items():
            if len(batch) == 1:
                i, state = batch[0]
                results[i] = self._draft(requests[i][0], state)
                continue
            try:
                proposals = together([s.session for _, s in batch], [s.seq for _, s in batch],
                                     [s.params for _, s in batch], [s.generator for _, s in batch])
            except Exception as exc:  # noqa: BLE001
                proposals = [exc] * len(batch)
            for (i, state), proposal in zip(batch, proposals):
                results[i] = proposal if isinstance(proposal, Exception) else self._message(requests[i][0], state, proposal)
        return results

    def propose(self, tag: int, path: list[int], tokens: list[int]) -> Proposal:
        return self._draft(tag, self._advance(tag, path, tokens))

    def _advance(self, tag: int, path: list[int], tokens: list[int]) -> TagState:
        """Apply the last round's outcome to the session's draft state."""
        state = self.states.get(tag)
        if state is None:
            raise UnknownTag(tag)
        check_token_ids(tokens, self.vocab_size)
        if len(state.seq) + len(tokens) + self.drafter.max_nodes > state.capacity:
            raise BadRequest(f"session {tag} grew past the {state.capacity} positions it reserved")
        if state.proposed:
            state.session.on_verified(path)
            state.rounds += 1
            state.drafted += state.last_depth
            state.accepted += len(path)
            self.total_rounds += 1
            self.total_drafted += state.last_depth
            self.total_accepted += len(path)
        state.seq.extend(tokens)
        return state

    def _draft(self, tag: int, state: TagState) -> Proposal:
        return self._message(tag, state, state.session.propose(state.seq, state.params, state.generator))

    def _message(self, tag: int, state: TagState, proposal) -> Proposal:
        state.proposed = True
        tree = proposal.tree
        state.last_depth = tree.max_depth
        q = None if proposal.draft_probs is None else Tensor.from_torch(proposal.draft_probs.float())
        return Proposal(tag, tree.tokens.tolist(), tree.parents.tolist(), tree.probs.tolist(), q)

    def close(self, tag: int) -> None:
        state = self.states.pop(tag, None)
        if state is not None:
            state.session.close()

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
        }
