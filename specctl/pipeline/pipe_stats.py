"""What a SpecPipe session (pipeline.specpipe) counts: its steps, hits and flushes, the levels
and rows it sent and dropped, its refills and its predicted chains — summed over a target's
sessions in its stats feed (pipeline.serve) and reported by ``bench pipeline``."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(slots=True)
class PipeStats:
    steps: int = 0  # verifications (one per level output that held the root)
    hits: int = 0  # the verified token was one of the root's children
    flushes: int = 0  # it was not, and the root had children: the pipeline refills
    levels_sent: int = 0
    stale_outputs: int = 0  # outputs of flushed trees, dropped on arrival
    bubbles: int = 0  # outputs of the live tree with nothing to verify (their level was wholly pruned)
    stage1_s: float = 0.0  # stage 1's time per level sent, summed: drafting it, then its own layers
    draft_lost: int = 0  # sessions that went on without their (remote) draft for a while
    draft_reopened: int = 0  # level sessions opened again after the draft went away (room again, link back)
    levels_dropped: int = 0  # levels in flight declared dead to the other stages (StageDrop)
    rows_dropped: int = 0  # pruned rows of levels in flight that keep live ones, declared dead
    refills: int = 0  # misses refilled with levels under the verified token in its forward
    refill_tokens: int = 0  # tokens decided by a forward's output after its first (chained through a refill)
    predicted: int = 0  # nodes of a request's predicted chains sent (pipeline.predicted)
    predicted_accepted: int = 0  # of the chains' tokens, those the target accepted
    predicted_rejected: int = 0  # chain tokens it did not (a rejected node and the rest of its chain)

    def add(self, other: "PipeStats") -> None:
        for counter in fields(self):  # every counter, a new one too
            setattr(self, counter.name, getattr(self, counter.name) + getattr(other, counter.name))

    @property
    def hit_rate(self) -> float:
        """The share of steps whose verified token was in the tree: a root left without children
        (its subtree not drafted, the draft gone) counts as a miss, as it costs one."""
        return self.hits / self.steps if self.steps else 0.0

    def to_dict(self) -> dict:
        """The counters, the hit rate and stage 1's time per level sent (for its seconds summed)."""
        counts = {counter.name: getattr(self, counter.name) for counter in fields(self) if counter.name != "stage1_s"}
        step_ms = round(1e3 * self.stage1_s / self.levels_sent, 3) if self.levels_sent else 0.0
        return {**counts, "hit_rate": round(self.hit_rate, 4), "stage1_step_ms": step_ms}
