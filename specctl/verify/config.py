"""A target instance's settings (``specctl verify``): listening, emulated device times for the
benchmarks, batching, and when to speculate by load."""

from __future__ import annotations

from dataclasses import dataclass

from specctl.runtime.listen import ListenConfig

MAX_PROPOSAL_NODES = 128  # also bounds a SpecPipe session's cached tree


@dataclass(slots=True)
class TargetServerConfig(ListenConfig):
    verify_delay_s: float = 0.0  # emulate a slower target (bench star), never in production
    verify_floor_s: float = 0.0  # emulate a target device: a verification takes at least this long (bench prespec)
    max_proposal_nodes: int = MAX_PROPOSAL_NODES  # larger proposals from a draft server are ignored (AR round)
    max_batch: int = 8  # most sessions verified together in one target forward
    # speculate while the instance runs at most this many sessions; past it, plain rounds (spec.turns); 0 = always
    spec_max_sessions: int = 0
    spec_depth_by_load: tuple[tuple[int, int], ...] = ()  # (sessions, the deepest proposal from then on)
    spec_depth_auto: bool = False  # each load's depth (or plain rounds) learnt from the rounds (spec.depth_tuning)

    def __post_init__(self) -> None:
        ListenConfig.__post_init__(self)
        if self.verify_delay_s < 0 or self.verify_floor_s < 0 or self.max_proposal_nodes < 1 or self.max_batch < 1:
            raise ValueError("verify_delay_s and verify_floor_s must be >= 0, max_proposal_nodes and max_batch >= 1")
        if self.spec_max_sessions < 0:
            raise ValueError(f"spec_max_sessions must be >= 0 (0: always speculate), got {self.spec_max_sessions}")
