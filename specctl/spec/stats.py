"""What a round did (RoundResult) and the one recorder of rounds (GenerationStats), used
per session and, summed, per target instance.

One definition: a *round* is one verification forward after the prefill. A round whose
proposal held draft tokens is a *draft* (vLLM's ``num_drafts``); the others are
autoregressive rounds (``ar_rounds``), by choice (mode ar, an n-gram miss) or because the
draft failed (``fallback_rounds``). Acceptance figures are over drafts only."""

from __future__ import annotations

from dataclasses import dataclass, field

# Why a round ran autoregressively although a draft was wanted.
FALLBACK_DRAFT_DOWN = "draft_down"  # no link to a draft server, or it refused the session
FALLBACK_DRAFT_FAILED = "draft_failed"  # the draft server answered with an error or not in time
FALLBACK_BAD_PROPOSAL = "bad_proposal"  # a proposal that does not fit the session was dropped


@dataclass(frozen=True, slots=True)
class RoundResult:
    depth: int  # draft tokens on the proposal's longest path; 0 = an autoregressive round
    nodes: int  # proposal nodes verified, root excluded
    accepted: int  # draft tokens accepted
    committed: int  # tokens the round emitted (accepted + bonus, less what a stop cut)
    draft_s: float  # drafting here, or waiting for the draft server's proposal
    verify_s: float  # from handing the proposal to the target's compute to its outcome
    fallback: str | None = None  # why it ran autoregressively, when a draft was wanted
    predicted: bool = False  # its draft came from the request's prediction (spec.prediction)
    by_load: bool = False  # plain by choice: the instance ran more sessions than speculation pays for (spec.turns)


def counted_draft(depth: int, accepted: int, committed: int) -> tuple[int, int]:
    """(drafted, accepted) as the stats count a round of ``depth`` draft tokens, ``accepted``
    of them, ``committed`` emitted. When an end (EOS, a stop string, max_tokens) cut the round
    inside its accepted tokens, the positions past the cut decided nothing: counting them made
    a one-token reply read 4 tokens a round."""
    if depth == 0 or committed > accepted:
        return depth, accepted
    return max(committed, 1), committed


@dataclass(slots=True)
class GenerationStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of them, restored from the prefix cache rather than computed
    new_tokens: int = 0
    rounds: int = 0  # verification rounds (the prefill's first token is not a round)
    drafts: int = 0  # rounds that verified draft tokens
    drafted: int = 0  # draft positions offered (proposal depth), summed over drafts
    accepted: int = 0  # draft tokens accepted, summed over drafts
    tree_nodes: int = 0  # proposal nodes verified (root excluded)
    fallback_rounds: int = 0  # autoregressive rounds because the draft was down, failed or sent a bad proposal
    load_rounds: int = 0  # autoregressive rounds because the instance was loaded past its spec_max_sessions
    accepted_per_pos: list[int] = field(default_factory=list)  # how often position i was accepted
    prediction_accepted: int = 0  # of the accepted draft tokens, those drafted from the request's prediction
    prediction_rejected: int = 0  # tokens drafted from the prediction that verification rejected
    prefill_s: float = 0.0
    prefill_compute_s: float = 0.0  # of it, the prefill's jobs on the compute thread (other sessions waited)
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0

    @property
    def ar_rounds(self) -> int:
        return self.rounds - self.drafts

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per draft round: the accepted draft tokens plus the target's bonus."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def record(self, result: RoundResult) -> None:
        self.rounds += 1
        self.draft_s += result.draft_s
        self.verify_s += result.verify_s
        if result.fallback is not None:
            self.fallback_rounds += 1
        self.load_rounds += result.by_load
        if result.depth == 0:
            return
        self.drafts += 1
        self.drafted += result.depth
        self.tree_nodes += result.nodes
        self.accepted += result.accepted
        if result.predicted:
            self.prediction_accepted += result.accepted
            self.prediction_rejected += result.nodes - result.accepted
        while len(self.accepted_per_pos) < result.depth:
            self.accepted_per_pos.append(0)
        for i in range(result.accepted):
            self.accepted_per_pos[i] += 1

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "drafts": self.drafts,
            "ar_rounds": self.ar_rounds,
            "fallback_rounds": self.fallback_rounds,
            "load_rounds": self.load_rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tree_nodes": self.tree_nodes,
            "accepted_per_pos": list(self.accepted_per_pos),
            "prediction_accepted": self.prediction_accepted,
            "prediction_rejected": self.prediction_rejected,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "prefill_ms": round(self.prefill_s * 1e3, 2),
            "draft_ms": round(self.draft_s * 1e3, 2),
            "verify_ms": round(self.verify_s * 1e3, 2),
            "wall_ms": round(self.wall_s * 1e3, 2),
        }
