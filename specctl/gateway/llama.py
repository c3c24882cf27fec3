"""llama.cpp's own completion API, which its clients and editor plugins call: ``POST
/completion`` (also ``/completions``) and the answer ``/infill`` shares (gateway.infill).

A request becomes the OpenAI completion it amounts to — its prompt as token ids, llama.cpp's
sampling defaults where it leaves them out (temperature 0.8, top-k 40, top-p 0.95, min-p
0.05), ``n_predict`` -1 (its default) to the end of the context — and is answered in
llama.cpp's shape: ``content``, ``tokens``, ``stop``, ``stop_type`` (eos | limit | word),
``stopping_word``, ``tokens_predicted``, ``tokens_evaluated``, ``tokens_cached``,
``timings``; streamed, as its server-sent events (``content`` and ``tokens`` as they come,
then the whole answer with ``stop: true``; no ``[DONE]``).

The prompt may be text, token ids, or both mixed (``[12, 34, "text", 56]``; BOS where the
prompt starts with text and the tokenizer adds one), or a list of such prompts, answered as
a list. ``grammar`` (GBNF) and ``json_schema`` hold the output as vLLM's guided_grammar and
guided_json do; ``repeat_penalty`` is vLLM's repetition_penalty (over the whole text, not
llama.cpp's last ``repeat_last_n`` tokens); a ``logit_bias`` of ``false`` is -100."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
from aiohttp import web

from specctl.engine.text import encode_prompt
from specctl.gateway.api import MAX_CHOICES, ApiError, CompletionRequest, parse_body
from specctl.gateway.choices import Choices, Event
from specctl.gateway.respond import remote_message
from specctl.verify.client import RemoteError

BANNED_BIAS = -100.0  # a logit_bias of false: OpenAI's lowest bias, which no token overcomes


class LlamaOptions(msgspec.Struct, kw_only=True):
    """The options of llama.cpp's /completion this gateway serves (others are ignored, named
    once in the log)."""
    model: str | None = None
    n_predict: int = -1
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1  # -1: a random one
    stop: list[str] = []
    stream: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    logit_bias: list[list[Any]] | dict[str, Any] | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    n_probs: int = 0
    return_tokens: bool = False


class LlamaCompletionRequest(LlamaOptions, kw_only=True):
    endpoint: ClassVar[str] = "/completion"  # named in the log of fields it ignores
    prompt: str | list[int | str | list[int | str]]


def parse_completion(body: bytes, tokenizer: Any, context: int, model: str) -> tuple[CompletionRequest, "LlamaReply"]:
    """A /completion body as the completion request it amounts to, and what answers it."""
    started = time.perf_counter()
    asked = parse_body(body, LlamaCompletionRequest)
    prompts, listed = llama_prompts(asked.prompt, tokenizer)
    req = completion_request(asked, prompts, context)
    return req, LlamaReply(model, prompts, listed, asked.return_tokens,
                           generation_settings(req, asked, model, context), started)


def llama_prompts(prompt: str | list, tokenizer: Any) -> tuple[list[list[int]], bool]:
    """The prompts as token ids, and whether they came as a list of prompts (answered as a list)."""
    if isinstance(prompt, str):
        return [_mixed([prompt], tokenizer)], False
    if prompt and (all(isinstance(p, str) for p in prompt) or any(isinstance(p, list) for p in prompt)):
        if any(isinstance(p, int) for p in prompt):
            raise ApiError(400, "a list of prompts holds strings or lists, not bare token ids", param="prompt")
        if len(prompt) > MAX_CHOICES:
            raise ApiError(400, f"at most {MAX_CHOICES} prompts a request, got {len(prompt)}", param="prompt")
        return [_mixed([p] if isinstance(p, str) else p, tokenizer) for p in prompt], True
    return [_mixed(prompt, tokenizer)], False


def _mixed(pieces: list[int | str], tokenizer: Any) -> list[int]:
    """Token ids and text pieces, as llama.cpp joins them: BOS only before a leading text."""
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            ids += encode_prompt(tokenizer, piece) if i == 0 else tokenizer.encode(piece, add_special_tokens=False)
        else:
            ids.append(piece)
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return ids


def completion_request(asked: LlamaOptions, prompts: list[list[int]], context: int,
                       ends: tuple[int, ...] = ()) -> CompletionRequest:
    """The OpenAI completion request ``asked`` amounts to (``ends``: stop token ids it implies)."""
    if asked.n_predict == 0 or asked.n_predict < -1:
        raise ApiError(400, f"n_predict must be -1 (to the end of the context) or at least 1, got {asked.n_predict}",
                       param="n_predict")
    if asked.n_probs:
        raise ApiError(400, "n_probs is not served on this endpoint: /v1/completions lists each token's "
                            "alternatives with logprobs", param="n_probs")
    if asked.grammar is not None and asked.json_schema is not None:
        raise ApiError(400, "give grammar or json_schema, not both", param="grammar")
    room = max(1, context - max(map(len, prompts)))  # a prompt past the context: the completion's own 400 says so
    return CompletionRequest(
        model=asked.model, prompt=prompts if len(prompts) > 1 else prompts[0], max_tokens=room if asked.n_predict == -1 else asked.n_predict,
        temperature=asked.temperature, top_k=asked.top_k, top_p=asked.top_p, min_p=asked.min_p,
        seed=None if asked.seed == -1 else asked.seed, stop=asked.stop or None, ignore_eos=asked.ignore_eos,
        stream=asked.stream,
        presence_penalty=asked.presence_penalty, frequency_penalty=asked.frequency_penalty,
        repetition_penalty=asked.repeat_penalty, logit_bias=openai_bias(asked.logit_bias),
        guided_grammar=asked.grammar, guided_json=asked.json_schema, stop_token_ids=list(ends) or None)


def openai_bias(bias: list[list[Any]] | dict[str, Any] | None) -> dict[str, float] | None:
    """llama.cpp's ``[[id, bias], ...]`` or ``{"id": bias}`` (``false``: never) as OpenAI's map."""
    if not bias:
        return None
    pairs = bias.items() if isinstance(bias, dict) else bias
    found: dict[str, float] = {}
    for pair in pairs:
        if len(pair) != 2 or isinstance(pair[1], str):
            raise ApiError(400, "logit_bias entries are [token id, bias or false]", param="logit_bias")
        token, value = pair
        if isinstance(token, str) and not token.strip().isdigit():
            raise ApiError(400, f"logit_bias by text ({token!r}) is not served here: give token ids (POST /tokenize "
                                "turns text into them)", param="logit_bias")
        found[str(int(token))] = BANNED_BIAS if value is False else float(value)
    return found


@dataclass(slots=True)
class LlamaReply:
    """A llama.cpp answer from a request's choices: one body, a list of them (a list of
    prompts), or server-sent events."""
    model: str
    prompts: list[list[int]]
    listed: bool  # the request gave a list of prompts
    return_tokens: bool
    settings: dict  # generation_settings: the options as served
    started: float

    async def collect(self, choices: Choices) -> web.Response:
        texts: dict[int, list[str]] = {}
        tokens: dict[int, list[int]] = {}
        first: dict[int, float] = {}
        bodies = {}
        async for index, event in choices.events():
            texts.setdefault(index, []).append(event.delta)
            tokens.setdefault(index, []).extend(event.tokens)
            if event.count:
                first.setdefault(index, time.perf_counter())
            if event.finish:
                bodies[index] = self._final(index, "".join(texts[index]), tokens[index], event, first.get(index))
        answer = [bodies[i] for i in sorted(bodies)]
        return web.json_response(answer if self.listed else answer[0])

    async def stream(self, request: web.Request, choices: Choices) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        first: dict[int, float] = {}
        texts: dict[int, str] = {}
        try:
            async for index, event in choices.events():
                if event.count:
                    first.setdefault(index, time.perf_counter())
                texts[index] = texts.get(index, "") + event.delta
                if event.delta or event.tokens:
                    await response.write(_event({"index": index, "content": event.delta,
                                                 "tokens": list(event.tokens), "stop": False, "id_slot": -1,
                                                 "tokens_predicted": event.count,
                                                 "tokens_evaluated": len(self.prompts[index])}))
                if event.finish:
                    await response.write(_event(self._final(index, "", [], event, first.get(index), texts[index])))
        except RemoteError as exc:  # the headers are gone: the error travels in the stream, as llama.cpp's does
            await response.write(_event({"error": {"code": 502, "message": remote_message(exc),
                                                   "type": "server_error"}}))
        await response.write_eof()
        return response

    def _final(self, index: int, content: str, tokens: list[int], event: Event, first_at: float | None,
               whole: str | None = None) -> dict:
        """A prompt's whole answer (streamed: its last event, ``content`` already sent, ``whole``)."""
        now, evaluated, predicted = time.perf_counter(), len(self.prompts[index]), event.count
        prompt_s = (first_at or now) - self.started
        predicted_s = now - first_at if first_at is not None else 0.0
        word = event.stop_reason if isinstance(event.stop_reason, str) else ""
        return {
            "index": index, "content": content, "tokens": tokens if self.return_tokens else [], "id_slot": -1,
            "stop": True, "model": self.model, "tokens_predicted": predicted, "tokens_evaluated": evaluated,
            "tokens_cached": event.stats.get("cached_prompt_tokens", 0), "generation_settings": self.settings,
            "has_new_line": "\n" in (content if whole is None else whole), "truncated": False,
            "stop_type": "limit" if event.finish == "length" else "word" if word else "eos", "stopping_word": word,
            "timings": {"prompt_n": evaluated, "prompt_ms": round(prompt_s * 1e3, 3),
                        "prompt_per_second": round(evaluated / prompt_s, 3) if prompt_s > 0 else None,
                        "predicted_n": predicted, "predicted_ms": round(predicted_s * 1e3, 3),
                        "predicted_per_token_ms": round(predicted_s * 1e3 / predicted, 3) if predicted else None,
                        "predicted_per_second": round(predicted / predicted_s, 3) if predicted_s > 0 else None},
        }


def generation_settings(req: CompletionRequest, asked: LlamaOptions, model: str, context: int) -> dict:
    """llama.cpp's generation_settings: the options as this request is served."""
    return {"n_ctx": context, "model": model, "n_predict": req.max_tokens, "temperature": req.temperature,
            "top_k": req.top_k, "top_p": req.top_p, "min_p": req.min_p, "seed": asked.seed, "stop": asked.stop,
            "ignore_eos": asked.ignore_eos, "presence_penalty": asked.presence_penalty,
            "frequency_penalty": asked.frequency_penalty, "repeat_penalty": asked.repeat_penalty,
            "stream": asked.stream, "speculative": True}


def _event(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()
