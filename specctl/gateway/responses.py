"""OpenAI response bodies and SSE stream chunks, as pure functions of what was generated.
``specctl`` in a body is our extension: the speculative-decoding statistics of the request."""

from __future__ import annotations

import json
import time
import uuid


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def spec_summary(stats: dict) -> dict:
    keys = ("rounds", "drafted", "accepted", "mean_accepted_length", "acceptance_rate", "tokens_per_s")
    return {key: stats[key] for key in keys if key in stats}


def full_response(rid: str, model: str, chat: bool, text: str, finish_reason: str, prompt_tokens: int,
                  completion_tokens: int, stats: dict, created: int | None = None) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created or int(time.time()),
        "model": model, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens),
        "specctl": spec_summary(stats),
    }


def chunk(rid: str, model: str, chat: bool, created: int, text: str | None = None, finish_reason: str | None = None,
          role: bool = False, extra: dict | None = None) -> dict:
    """One streamed chunk: a text delta, the opening role (chat) or the closing finish_reason."""
    if chat:
        delta: dict = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}
    body.update(extra or {})
    return body


def usage_chunk(rid: str, model: str, chat: bool, created: int, prompt_tokens: int, completion_tokens: int) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, only usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def sse(body: dict | str) -> bytes:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()


def models_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "specctl"}]}
