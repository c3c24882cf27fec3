"""What every server role is configured with: where to listen and what to refuse."""

from __future__ import annotations

from dataclasses import dataclass

from specctl.net.protocol import MAX_FRAME_BYTES


@dataclass(slots=True)
class ListenConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    max_sessions: int = 64
    max_frame_bytes: int = MAX_FRAME_BYTES
    kv_budget_bytes: int | None = None
    auth_token: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        if self.max_frame_bytes < 1024:
            raise ValueError("max_frame_bytes must be >= 1024")
