"""A chat's conversation saved to a JSON file and read back (``/save FILE``, ``/load FILE``):
the system prompt, the settings and the messages, so a conversation can go on later or be sent
as an OpenAI request as it stands (``messages`` is that request's list, without the system
prompt)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specctl.gateway.translate import REASONING_EFFORTS

ROLES = ("user", "assistant")


class TranscriptError(ValueError):
    """A file that is not a conversation /save wrote: the message says what is wrong."""


def save(path: str | Path, state: Any) -> int:
    """Writes ``state`` (a ChatState) to ``path``; returns the number of messages."""
    body = {"system": state.system, "temperature": state.temperature, "max_tokens": state.max_tokens,
            "reasoning_effort": state.reasoning_effort, "messages": state.messages}
    Path(path).expanduser().write_text(json.dumps(body, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return len(state.messages)


def load(path: str | Path) -> dict:
    """The saved fields (system, temperature, max_tokens, reasoning_effort, messages), checked; a TranscriptError
    (or OSError for a file that cannot be read) otherwise."""
    try:
        body = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TranscriptError(f"not JSON: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise TranscriptError("not a saved conversation: no \"messages\" list")
    for i, message in enumerate(body["messages"]):
        if (not isinstance(message, dict) or message.get("role") not in ROLES
                or not isinstance(message.get("content"), str)):
            raise TranscriptError(f"message {i} must be {{\"role\": \"user\" or \"assistant\", "
                                  f"\"content\": text}}")
    system, temperature, max_tokens = body.get("system", ""), body.get("temperature", 0.0), body.get("max_tokens", 256)
    if not isinstance(system, str):
        raise TranscriptError("\"system\" must be text")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 100:
        raise TranscriptError("\"temperature\" must be a number between 0 and 100")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise TranscriptError("\"max_tokens\" must be a whole number of at least 1")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise TranscriptError(f"\"reasoning_effort\" must be null or one of {', '.join(REASONING_EFFORTS)}")
    return {"system": system, "temperature": float(temperature), "max_tokens": max_tokens, "reasoning_effort": effort,
            "messages": [{"role": m["role"], "content": m["content"]} for m in body["messages"]]}
