"""Per-session statistics of the propose -> verify -> accept loop."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0  # speculative rounds (the prefill's first token is not a round)
    drafted: int = 0  # draft positions offered (proposal depth), summed over rounds
    accepted: int = 0  # draft tokens accepted, summed over rounds
    tree_nodes: int = 0  # proposal nodes verified (root excluded)
    accepted_per_pos: list[int] = field(default_factory=list)  # how often position i was accepted
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per round: the accepted draft tokens plus the target's bonus."""
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def record_round(self, depth: int, nodes: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += depth
        self.tree_nodes += nodes
        self.accepted += accepted
        while len(self.accepted_per_pos) < depth:
            self.accepted_per_pos.append(0)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tree_nodes": self.tree_nodes,
            "accepted_per_pos": list(self.accepted_per_pos),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "prefill_ms": round(self.prefill_s * 1e3, 2),
            "draft_ms": round(self.draft_s * 1e3, 2),
            "verify_ms": round(self.verify_s * 1e3, 2),
            "wall_ms": round(self.wall_s * 1e3, 2),
        }
