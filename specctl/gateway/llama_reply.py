"""llama.cpp's answer to /completion and /infill (gateway.llama, gateway.infill): ``content``,
``tokens``, ``stop``, ``stop_type`` (eos | limit | word), ``stopping_word``,
``tokens_predicted``, ``tokens_evaluated``, ``tokens_cached``, ``generation_settings``,
``timings``; a list of them for a list of prompts; streamed, as its server-sent events
(``content`` and ``tokens`` as they come, then the whole answer with ``stop: true``; no
``[DONE]``).

The rules editor plugins rely on are applied to the text as it comes, as llama.cpp applies
them: ``n_indent`` (a later line that starts indented less than that ends the text, cut
where its content starts), ``t_max_predict_ms`` (past that time since the first token, a
newline in the text ends it) and ``n_predict`` 0 (the prompt evaluated, nothing handed out).
Either ends the generation (stop_type ``limit``); ``response_fields`` keeps only the fields
named, ``"timings/prompt_n"`` lifted out under that name, as llama.vim reads them."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from specctl.engine.text import token_bytes_of
from specctl.gateway.api import ApiError
from specctl.gateway.keepalive import event_stream
from specctl.gateway.choices import Choices, Event
from specctl.gateway.respond import json_answer, stream_failure
from specctl.verify.client import RemoteError


@dataclass(frozen=True, slots=True)
class Rules:
    n_indent: int = 0
    t_max_predict_s: float = 0.0  # 0: off
    evaluate_only: bool = False  # n_predict 0


class Probabilities:
    """llama.cpp's completion_probabilities (n_probs): each token's id, text, bytes and
    log-probability (its probability with post_sampling_probs), with its likeliest alternatives."""

    def __init__(self, tokenizer: Any, as_probs: bool = False) -> None:
        self.tokenizer, self.as_probs = tokenizer, as_probs
        self.token_bytes = _token_bytes(tokenizer)

    def entries(self, scored: list) -> list[dict]:
        key, top = ("prob", "top_probs") if self.as_probs else ("logprob", "top_logprobs")
        return [{**self._one(e.token, e.logprob, key),
                 top: [self._one(i, lp, key) for i, lp in zip(e.top_ids, e.top_logprobs)]} for e in scored]

    def _one(self, token: int, logprob: float, key: str) -> dict:
        value = math.exp(logprob) if self.as_probs else logprob
        return {"id": token, "token": self.tokenizer.decode([token]), key: value,
                "bytes": list(self.token_bytes(token))}


_token_bytes = functools.lru_cache(maxsize=8)(token_bytes_of)  # built once per tokenizer (it reads the vocabulary)


@dataclass(slots=True)
class Output:
    """One prompt's answer so far."""
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    scored: list = field(default_factory=list)  # its tokens' R.TokenLogprob (n_probs)
    first_at: float | None = None  # when its first token came
    cut: bool = False  # a rule ended it
    done: bool = False


def indent_cut(text: str, n_indent: int) -> int | None:
    """Where ``n_indent`` ends ``text``: at the content of the first line after the first that
    starts (spaces and tabs counted) less indented, an empty line included; None if none does."""
    newline = text.find("\n")
    while newline != -1:
        pos = start = newline + 1
        while pos < len(text) and text[pos] in " \t":
            pos += 1
        if pos < len(text) and pos - start < n_indent:
            return pos
        newline = text.find("\n", start)
    return None


def selected(body: dict, fields: list[str] | None) -> dict:
    """llama.cpp's response_fields: the fields named, a path "a/b" taken out of "a" and kept
    under its path; a path that is not there is left out."""
    if fields is None:
        return body
    chosen = {}
    for path in fields:
        value = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            chosen[path] = value
    return chosen


@dataclass(slots=True)
class LlamaReply:
    model: str
    prompts: list[list[int]]
    listed: bool  # the request gave a list of prompts: a list of answers
    return_tokens: bool
    settings: dict  # generation_settings: the options as served
    started: float
    rules: Rules = Rules()
    response_fields: list[str] | None = None
    probabilities: Probabilities | None = None  # n_probs asked

    async def collect(self, choices: Choices) -> web.Response:
        outputs: dict[int, Output] = {}
        bodies: dict[int, dict] = {}
        async for index, event, out, _ in self._events(choices, outputs):
            if out.done:
                bodies[index] = selected(self._final(index, out, event), self.response_fields)
        answer = [bodies[i] for i in sorted(bodies)]
        return await json_answer(lambda: answer if self.listed else answer[0])

    async def stream(self, request: web.Request, choices: Choices) -> web.StreamResponse:
        response = await event_stream(request)
        try:
            async for index, event, out, delta in self._events(choices, {}):
                if event.prompt_progress is not None:  # llama.cpp's: an empty partial event beside it
                    await response.write(_event({"index": index, "content": "", "tokens": [], "stop": False,
                                                 "id_slot": -1, "tokens_predicted": 0,
                                                 "tokens_evaluated": len(self.prompts[index]),
                                                 "prompt_progress": event.prompt_progress}))
                    continue
                if delta or (event.tokens and not self.rules.evaluate_only):
                    partial = {"index": index, "content": delta, "tokens": list(event.tokens), "stop": False,
                               "id_slot": -1, "tokens_predicted": event.count,
                               "tokens_evaluated": len(self.prompts[index])}
                    if self.probabilities is not None:
                        partial["completion_probabilities"] = self.probabilities.entries(event.logprobs)
                    await response.write(_event(partial))
                if out.done:
                    final = {**self._final(index, out, event), "content": "", "tokens": []}
                    final.pop("completion_probabilities", None)  # each partial event carried its tokens'
                    await response.write(_event(final))
        except (RemoteError, ApiError) as exc:  # headers are gone: the error travels in the stream, as llama.cpp's
            error = stream_failure(exc)
            await response.write(_event({"error": {"code": error.status, "message": str(error),
                                                   "type": "server_error"}}))
        await response.write_eof()
        return response

    async def _events(self, choices: Choices, outputs: dict[int, Output]):
        """(index, event, its output, the text it adds) until every prompt's answer is done; a
        rule that ends one stops reading it (and ends the request when it was the last)."""
        running = len(choices.specs)
        async with contextlib.aclosing(choices.events()) as events:
            async for index, event in events:
                out = outputs.setdefault(index, Output())
                if out.done:
                    continue
                delta = self._take(out, event, time.perf_counter())
                out.done = out.cut or event.finish is not None
                yield index, event, out, delta
                running -= out.done
                if not running:
                    return

    def _take(self, out: Output, event: Event, now: float) -> str:
        """Add the event to the output under the rules; the text it adds."""
        if event.count and out.first_at is None:
            out.first_at = now
        if self.rules.evaluate_only:
            out.cut = event.count > 0
            return ""
        before = len(out.text)
        out.text += event.delta
        out.tokens += event.tokens
        out.scored += event.logprobs
        cut = indent_cut(out.text, self.rules.n_indent) if self.rules.n_indent else None
        if cut is not None:
            out.text, out.cut = out.text[: max(cut, before)], True
        elif (self.rules.t_max_predict_s and "\n" in out.text and out.first_at is not None
              and now - out.first_at > self.rules.t_max_predict_s):
            out.cut = True
        return out.text[before:]

    def _final(self, index: int, out: Output, event: Event) -> dict:
        """A prompt's whole answer."""
        now, evaluated = time.perf_counter(), len(self.prompts[index])
        predicted = 0 if self.rules.evaluate_only else event.count
        prompt_s = (out.first_at or now) - self.started
        predicted_s = now - out.first_at if out.first_at is not None and predicted else 0.0
        word = event.stop_reason if isinstance(event.stop_reason, str) and not out.cut else ""
        probabilities = {} if self.probabilities is None else {
            "completion_probabilities": self.probabilities.entries(out.scored)}
        return {**probabilities,
            "index": index, "content": out.text, "tokens": out.tokens if self.return_tokens else [], "id_slot": -1,
            "stop": True, "model": self.model, "tokens_predicted": predicted, "tokens_evaluated": evaluated,
            "tokens_cached": event.stats.get("cached_prompt_tokens", 0), "generation_settings": self.settings,
            "has_new_line": "\n" in out.text, "truncated": False,
            "stop_type": "limit" if out.cut or event.finish == "length" else "word" if word else "eos",
            "stopping_word": word,
            "timings": {"prompt_n": evaluated, "prompt_ms": round(prompt_s * 1e3, 3),
                        "prompt_per_token_ms": round(prompt_s * 1e3 / evaluated, 3),
                        "prompt_per_second": round(evaluated / prompt_s, 3) if prompt_s > 0 else None,
                        "predicted_n": predicted, "predicted_ms": round(predicted_s * 1e3, 3),
                        "predicted_per_token_ms": round(predicted_s * 1e3 / predicted, 3) if predicted else None,
                        "predicted_per_second": round(predicted / predicted_s, 3) if predicted_s > 0 else None},
        }


def _event(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()
