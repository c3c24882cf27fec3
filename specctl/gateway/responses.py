"""OpenAI response bodies and SSE stream chunks, as pure functions of what was generated.
``specctl`` in a body is our extension: the speculative-decoding statistics of the request."""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple, Sequence

from rapidfuzz.distance import LCSseq

if TYPE_CHECKING:
    from specctl.net.protocol import Tokens


class TokenLogprob(NamedTuple):
    """One output token's log-probability under the target and its likeliest alternatives."""
    token: int
    logprob: float | None  # None: an echoed prompt's first token (nothing precedes it)
    top_ids: list[int]
    top_logprobs: list[float]
    rank: int | None = None  # its rank in its row (vLLM's); None where the target did not say


LOWEST_LOGPROB = -9999.0  # what vLLM writes for -inf, which JSON cannot carry


def prompt_logprobs(prompt: list[int], first: Tokens) -> list[TokenLogprob]:
    """The prompt's tokens with their log-probabilities and ranks (sent with the first TOKENS);
    its first token has none."""
    return [TokenLogprob(prompt[0], None, [], []),
            *map(TokenLogprob, prompt[1:], first.prompt_logprobs, first.prompt_top_ids, first.prompt_top_logprobs,
                 first.prompt_ranks)]


def echoed(scored: list[TokenLogprob] | None, alternatives: int | None) -> list[TokenLogprob]:
    """An echoed prompt's entries in the output's logprobs: ``alternatives`` each (the scoring
    pass may have listed more, for vLLM's prompt_logprobs); none when logprobs were not asked."""
    if scored is None or alternatives is None:
        return []
    return [e._replace(top_ids=e.top_ids[:alternatives], top_logprobs=e.top_logprobs[:alternatives]) for e in scored]


def new_id(chat: bool, request_id: str | None = None) -> str:
    """An answer's id: the request's (gateway.request_id) or a fresh one, as OpenAI prefixes them."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{request_id or uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, predicted: dict | None = None) -> dict:
    """OpenAI's usage; ``cached_tokens``: prompt tokens the targets' prefix caches served;
    ``predicted``: a request's prediction's counts (``prediction_details``), when it gave one."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if predicted is not None:
        body["completion_tokens_details"] = predicted
    return body


def cached_tokens(stats: dict[int, dict], n: int) -> int:
    """Prompt tokens served from prefix caches: each prompt's first choice's (its other choices
    read the same prompt, so it is counted once, as ``prompt_tokens`` counts it)."""
    return sum(s.get("cached_prompt_tokens", 0) for index, s in stats.items() if index % n == 0)


def prediction_details(prediction: Sequence[int], outputs: Iterable[Sequence[int]]) -> dict:
    """OpenAI's completion_tokens_details for a request with a prediction, as OpenAI defines them:
    the prediction's tokens that appear in the completion — their longest common subsequence —
    and the rest, summed over the choices. (What verification checked of the prediction is the
    stats' prediction_accepted and prediction_rejected: spec.prediction.) rapidfuzz's LCS is
    bit-parallel, len(prediction) x len(output) / 64 word operations: a 128k-token prediction
    against 8k tokens of output about 10 ms."""
    found = [LCSseq.similarity(prediction, output) for output in outputs]
    return {"accepted_prediction_tokens": sum(found),
            "rejected_prediction_tokens": sum(len(prediction) - n for n in found)}


def spec_summary(stats: dict) -> dict:
    keys = ("rounds", "drafted", "accepted", "mean_accepted_length", "acceptance_rate", "tokens_per_s",
            "fallback_rounds", "load_rounds",  # rounds run without a proposal (draft down, late, refused; the
            # instance loaded past where speculation pays): slower, never different
            "resumes", "resumed_tokens")  # instances lost under it; the rest are the last one's, from resumed_tokens
    return {key: stats[key] for key in keys if key in stats}


def logprobs_body(chat: bool, entries: list[TokenLogprob] | None, token_text: Callable[[int], str],
                  offset: int = 0, token_bytes: Callable[[int], bytes] | None = None, as_ids: bool = False) -> dict | None:
    """OpenAI's ``logprobs`` of a choice (None when not asked for). Chat: ``content``, a list of
    {token, logprob, bytes (the token's raw bytes: ``token_bytes``), top_logprobs}. Completions:
    the legacy parallel lists — tokens, token_logprobs, top_logprobs (the token and its
    alternatives, as vLLM lists them) and each token's text_offset from ``offset`` (the text
    handed out before these tokens). ``as_ids`` (vLLM's return_tokens_as_token_ids) names each token
    "token_id:<id>" (bytes and text offsets stay its text's)."""
    if entries is None:
        return None
    name = (lambda token: f"token_id:{token}") if as_ids else token_text
    if chat:
        raw = token_bytes or (lambda token: token_text(token).encode())

        def item(token: int, logprob: float) -> dict:
            return {"token": name(token), "logprob": logprob, "bytes": list(raw(token))}
        return {"content": [{**item(e.token, e.logprob),
                             "top_logprobs": [item(t, lp) for t, lp in zip(e.top_ids, e.top_logprobs)]}
                            for e in entries]}
    texts = [token_text(e.token) for e in entries]
    names = [name(e.token) for e in entries] if as_ids else texts
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": names, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else  # an echoed prompt's first token
                             {named: e.logprob, **{name(t): lp for t, lp in zip(e.top_ids, e.top_logprobs)}}
                             for named, e in zip(names, entries)],
            "text_offset": offsets}


def prompt_logprobs_body(entries: list[TokenLogprob], alternatives: int,
                         token_text: Callable[[int], str]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first (nothing precedes it), else
    {token id: {logprob, rank, decoded_token}} for the token and its ``alternatives`` likeliest
    (ranks 1, 2, ...; the token first, as vLLM lists it)."""
    def item(token: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": max(logprob, LOWEST_LOGPROB), "rank": rank, "decoded_token": token_text(token)}
    return [None if e.logprob is None else
            {str(e.token): item(e.token, e.logprob, e.rank),
             **{str(t): item(t, lp, rank) for rank, (t, lp) in
                enumerate(zip(e.top_ids[:alternatives], e.top_logprobs[:alternatives]), 1)}}
            for e in entries]


def spec_summaries(stats: list[dict]) -> dict:
    """The ``specctl`` summary of a request: its one generation's, or for several choices their
    rounds and tokens added up (the rates recomputed from the sums; tokens/s over the longest)."""
    if len(stats) == 1:
        return spec_summary(stats[0])
    total = {key: sum(s.get(key, 0) for s in stats) for key in ("rounds", "drafts", "drafted", "accepted", "new_tokens")}
    wall_s = max((s.get("wall_ms", 0.0) for s in stats), default=0.0) / 1e3
    resumes = sum(s.get("resumes", 0) for s in stats)
    return {"rounds": total["rounds"], "drafted": total["drafted"], "accepted": total["accepted"],
            "mean_accepted_length": round(1 + total["accepted"] / total["drafts"], 4) if total["drafts"] else 0.0,
            "acceptance_rate": round(total["accepted"] / total["drafted"], 4) if total["drafted"] else 0.0,
            "tokens_per_s": round(total["new_tokens"] / wall_s, 3) if wall_s > 0 else 0.0,
            **({"resumes": resumes} if resumes else {})}


def choice(chat: bool, index: int, text: str | None, finish_reason: str, logprobs: dict | None = None,
           tool_calls: list[dict] | None = None, reasoning: tuple[str | None] = (),
           stop_reason: str | int | None = None) -> dict:
    """``reasoning``: () without a reasoning parser, else (the thinking,) — None where there is
    none or it was left out — as vLLM's ``reasoning`` and its older name ``reasoning_content``;
    ``stop_reason``: vLLM's, the stop string or stop token id that ended the output."""
    if chat:
        message = {"role": "assistant", "content": text}
        if reasoning:
            message["reasoning"] = message["reasoning_content"] = reasoning[0]
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def full_response(rid: str, model: str, chat: bool, choices: list[dict], prompt_tokens: int, completion_tokens: int,
                  summary: dict, created: int | None = None, cached: int = 0, predicted: dict | None = None) -> dict:
    return {
        "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created or int(time.time()),
        "model": model, "choices": sorted(choices, key=lambda c: c["index"]),
        "usage": usage(prompt_tokens, completion_tokens, cached, predicted), "specctl": summary,
    }


def chunk(rid: str, model: str, chat: bool, created: int, text: str | None = None, finish_reason: str | None = None,
          role: bool = False, extra: dict | None = None, logprobs: dict | None = None, index: int = 0,
          tool_calls: list[dict] | None = None, reasoning: str | None = None,
          stop_reason: str | int | None = None, token_ids: list[int] | None = None) -> dict:
    """One streamed chunk: a text delta (with its tokens' logprobs), the opening role (chat),
    a piece of chat's thinking (gateway.reasoning), a choice's tool-call deltas
    (gateway.tool_calls) or the closing finish_reason."""
    if chat:
        delta: dict = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        if reasoning is not None:
            delta = {"reasoning": reasoning, "reasoning_content": reasoning}
        if tool_calls:
            delta = {"tool_calls": tool_calls}
        one = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        one = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    one["stop_reason"] = stop_reason
    if token_ids is not None:  # vLLM's return_token_ids: this chunk's new tokens
        one["token_ids"] = token_ids
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [one]}
    body.update(extra or {})
    return body


def usage_chunk(rid: str, model: str, chat: bool, created: int, prompt_tokens: int, completion_tokens: int,
                cached: int = 0, predicted: dict | None = None) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, only usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached, predicted)}


def sse(body: dict | str) -> bytes:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()


def model_card(name: str, created: int, context: int, root: str | None = None) -> dict:
    """OpenAI's model object, with vLLM's root (the model served under this name) and
    max_model_len."""
    return {"id": name, "object": "model", "created": created, "owned_by": "specctl", "root": root or name,
            "max_model_len": context}


def models_list(names: tuple[str, ...], created: int, context: int, root: str) -> dict:
    return {"object": "list", "data": [model_card(name, created, context, root) for name in names]}
