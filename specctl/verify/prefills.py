"""The prompts a target instance is reading: how many and how many tokens are left (its stats:
/metrics and the monitor show a long prefill that holds the compute thread), and PROMPT_PROGRESS
after each chunk to the requests that asked (llama.cpp's return_progress)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from specctl.net.protocol import PromptProgress

if TYPE_CHECKING:
    from specctl.spec.decode import DecodeSession


class Prefills:
    def __init__(self) -> None:
        self.sessions: dict[int, DecodeSession] = {}  # by id(): a session from its start to its last chunk

    def watch(self, session: DecodeSession, req: int, send: Callable | None = None) -> Callable[[], None]:
        """Count ``session`` as reading its prompt until its last chunk (or ``done``); returns
        run_session's ``prefilled``, which also sends PROMPT_PROGRESS when ``send`` is given."""
        self.sessions[id(session)] = session
        began = time.perf_counter()

        def chunk_done() -> None:
            if session.prefilled >= session.prompt_len:
                self.done(session)
            if send is not None:
                send(PromptProgress(req, session.prompt_len, session.stats.cached_prompt_tokens, session.prefilled,
                                    round((time.perf_counter() - began) * 1e3, 3)))
        return chunk_done

    def done(self, session: DecodeSession) -> None:
        """However the session ends, before or after its prompt is in."""
        self.sessions.pop(id(session), None)

    def snapshot(self) -> dict:
        left = sum(s.prompt_len - (s.prefilled or 0) for s in list(self.sessions.values()))
        return {"prefill_sessions": len(self.sessions), "prefill_tokens_left": left}
