"""OpenAI response bodies and SSE stream chunks, as pure functions of what was generated.
``specctl`` in a body is our extension: the speculative-decoding statistics of the request."""

from __future__ import annotations

import json
import time
import uuid
from typing import Callable, NamedTuple


class TokenLogprob(NamedTuple):
    """One output token's log-probability under the target and its likeliest alternatives."""
    token: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def spec_summary(stats: dict) -> dict:
    keys = ("rounds", "drafted", "accepted", "mean_accepted_length", "acceptance_rate", "tokens_per_s")
    return {key: stats[key] for key in keys if key in stats}


def logprobs_body(chat: bool, entries: list[TokenLogprob] | None, token_text: Callable[[int], str],
                  offset: int = 0, token_bytes: Callable[[int], bytes] | None = None) -> dict | None:
    """OpenAI's ``logprobs`` of a choice (None when not asked for). Chat: ``content``, a list of
    {token, logprob, bytes (the token's raw bytes: ``token_bytes``), top_logprobs}. Completions:
    the legacy parallel lists — tokens, token_logprobs, top_logprobs (the token and its
    alternatives, as vLLM lists them) and each token's text_offset from ``offset`` (the text
    handed out before these tokens)."""
    if entries is None:
        return None
    if chat:
        raw = token_bytes or (lambda token: token_text(token).encode())

        def item(token: int, logprob: float) -> dict:
            return {"token": token_text(token), "logprob": logprob, "bytes": list(raw(token))}
        return {"content": [{**item(e.token, e.logprob),
                             "top_logprobs": [item(t, lp) for t, lp in zip(e.top_ids, e.top_logprobs)]}
                            for e in entries]}
    texts = [token_text(e.token) for e in entries]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text: e.logprob, **{token_text(t): lp for t, lp in zip(e.top_ids, e.top_logprobs)}}
                             for text, e in zip(texts, entries)],
            "text_offset": offsets}


def full_response(rid: str, model: str, chat: bool, text: str, finish_reason: str, prompt_tokens: int,
                  completion_tokens: int, stats: dict, created: int | None = None, logprobs: dict | None = None) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created or int(time.time()),
        "model": model, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens),
        "specctl": spec_summary(stats),
    }


def chunk(rid: str, model: str, chat: bool, created: int, text: str | None = None, finish_reason: str | None = None,
          role: bool = False, extra: dict | None = None, logprobs: dict | None = None) -> dict:
    """One streamed chunk: a text delta (with its tokens' logprobs), the opening role (chat) or
    the closing finish_reason."""
    if chat:
        delta: dict = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
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
