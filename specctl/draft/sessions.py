"""Per-tag draft state. Touched only on the compute thread, so no locks: the asyncio side
checks ownership (a connection can only touch its own tags) before submitting work."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specctl.engine.kv_cache import KVPool
from specctl.errors import PromptTooLong
from specctl.engine.spec import check_token_ids
from specctl.net.protocol import OpenSession, Proposal, SparseProbs
from specctl.spec.draft_state import DraftState, draft_capacity, draft_many
from specctl.spec.drafters import Drafter, Proposal as DraftProposal
from specctl.spec.sampling import SamplingParams


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

    def open(self, tag: int, msg: OpenSession) -> None:
        params = SamplingParams(temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k, max_tokens=msg.max_tokens)
        check_token_ids(msg.prompt, self.vocab_size)
        if not msg.prompt or len(msg.prompt) + msg.max_tokens > self.max_context:
            raise PromptTooLong(f"prompt of {len(msg.prompt)} tokens plus max_tokens {msg.max_tokens} does not fit the draft's context of {self.max_context}")
        capacity = draft_capacity(len(msg.prompt), msg.max_tokens, self.drafter.max_nodes)
        session = self.drafter.open(capacity, self.pool)
        generator = torch.Generator().manual_seed(msg.seed)
        self.states[tag] = DraftState(session, params, generator, list(msg.prompt), capacity, self.drafter.max_nodes,
                                      self.vocab_size)

    def propose_many(self, requests: list[tuple[int, list[int], list[int]]]) -> list:
        """Serve many Propose requests in one pass (``draft_many``): one Proposal message or
        exception each. An outcome that does not fit its session is refused before drafting."""
        results: list = [None] * len(requests)
        ready: list[tuple[int, int, DraftState]] = []
        for i, (tag, path, tokens) in enumerate(requests):
            try:
                state = self.states.get(tag)
                if state is None:
                    raise UnknownTag(tag)
                before = state.rounds, state.drafted, state.accepted
                state.advance(path, tokens)
            except Exception as exc:  # noqa: BLE001 - reported to that request only
                results[i] = exc
                continue
            self.total_rounds += state.rounds - before[0]
            self.total_drafted += state.drafted - before[1]
            self.total_accepted += state.accepted - before[2]
            ready.append((i, tag, state))
        proposals = draft_many([state for _, _, state in ready])
        for (i, tag, _), proposal in zip(ready, proposals):
            results[i] = proposal if isinstance(proposal, Exception) else _message(tag, proposal)
        return results

    def close(self, tag: int) -> None:
        state = self.states.pop(tag, None)
        if state is not None:
            state.close()

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


def _message(tag: int, proposal: DraftProposal) -> Proposal:
    tree = proposal.tree
    q = None if proposal.draft_probs is None else SparseProbs.from_dense(proposal.draft_probs)
    return Proposal(tag, tree.tokens.tolist(), tree.parents.tolist(), q)
