"""A draft server's settings and what it keeps per target connection: the sessions (tags)
it opened, the proposals in flight, and the outgoing queue that lets a slow target never
block another."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from specctl.draft.plan import StarModel
from specctl.draft.speculation import PrespecConfig
from specctl.net.protocol import encode
from specctl.runtime.listen import ListenConfig


@dataclass(slots=True)
class DraftServerConfig(ListenConfig):
    max_sessions_per_connection: int = 64
    max_batch: int = 8  # most Propose requests drafted together in one pass
    admission_model: StarModel | None = None  # StarSD N_max admission, when given
    standalone_tokens_per_s: float | None = None
    prespec: PrespecConfig | None = None  # pre-speculation (chain or tree drafters), when on

    def __post_init__(self) -> None:
        ListenConfig.__post_init__(self)
        if self.max_sessions_per_connection < 1 or self.max_batch < 1:
            raise ValueError("max_sessions_per_connection and max_batch must be >= 1")


@dataclass(slots=True)
class Connection:
    id: int
    peer: str
    role: str
    writer: asyncio.StreamWriter
    outgoing: asyncio.Queue = field(default_factory=asyncio.Queue)
    tags: set[int] = field(default_factory=set)
    inflight: set[int] = field(default_factory=set)
    heard_at: float = field(default_factory=time.monotonic)  # its last frame (a live target's heartbeat at least)

    def send(self, message) -> int:
        """Queue one message; its frame's size in bytes."""
        frame = encode(message)
        self.outgoing.put_nowait(frame)
        return len(frame)
