"""SGLang's native API, which its users script against: ``POST /generate`` (its ``GET
/get_model_info``: gateway.text_routes).

A /generate request (``text`` or ``input_ids``, one or a batch; ``sampling_params``) becomes
the OpenAI completion it amounts to, with SGLang's defaults where it leaves fields out
(``max_new_tokens`` 128, temperature 1, top-p 1, every token; ``max_new_tokens`` 0 reads the
prompt only — its logprobs, the prefix cache), and is answered in SGLang's
shape: ``{"text", "output_ids", "meta_info"}`` — a list of them for a batch or ``n`` > 1 —
with ``meta_info``'s ``finish_reason`` ({"type": "length", "length": n} or {"type": "stop",
"matched": the stop string, or the EOS or stop token id}), token counts, ``e2e_latency`` and
the speculation's figures as SGLang names them (``spec_verify_ct``, ``spec_accept_length``,
...). Streamed, each event carries the text so far (SGLang's default, not increments) and
the stream ends with ``data: [DONE]``. ``json_schema`` (a JSON text), ``regex`` and ``ebnf``
hold the output as vLLM's guided_* do; ``no_stop_trim`` keeps the stop string;
``stop_regex`` ends the text with its pattern's first match (engine.stop_regex; matched: the
pattern). What specctl does not serve — images, audio, video, input embeddings, LoRA adapters,
custom logit processors, ``structural_tag`` — is a 400 saying what to give instead, never
answered as if it had not been asked.
``return_logprob`` gives the target's log-probabilities in meta_info (``output_token_logprobs``
as ``[logprob, id, text]``, ``output_top_logprobs`` with ``top_logprobs_num`` alternatives,
the input's from ``logprob_start_len``): lossless decoding makes them the target's own, of
its raw distribution (before temperature, as vLLM reports them; SGLang's with
SGLANG_RETURN_ORIGINAL_LOGPROB)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import msgspec
from aiohttp import web

from specctl.engine.text import encode_prompt
from specctl.gateway.keepalive import event_stream
from specctl.gateway.request_checks import check_prompt_chars
from specctl.gateway.api import ApiError, CompletionRequest
from specctl.gateway.request_body import parse_body
from specctl.gateway.choices import Choices, Event
from specctl.gateway.respond import json_answer, stream_failure
from specctl.verify.client import RemoteError


class SglangSampling(msgspec.Struct, kw_only=True):
    """SGLang's sampling_params (the ones served; others are ignored)."""
    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: every token
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    stop_regex: str | list[str] | None = None  # engine.stop_regex: the text ends with the match
    structural_tag: Any = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    endpoint: ClassVar[str] = "/generate"  # named in the log of fields it ignores
    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None  # one prompt's ids, or a batch's
    sampling_params: SglangSampling = msgspec.field(default_factory=SglangSampling)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1  # the prompt's logprobs from this position (-1: none)
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    model: str | None = None
    # refused when given (UNSERVED): each would change what the caller gets
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    input_embeds: Any = None
    lora_path: Any = None
    custom_logit_processor: Any = None


# SGLang's fields that specctl does not serve, with what to do instead: a request that gives one
# is refused, never answered as if it had not (an image left out, another output format)
UNSERVED = {
    "image_data": "specctl serves text prompts: leave it out",
    "audio_data": "specctl serves text prompts: leave it out",
    "video_data": "specctl serves text prompts: leave it out",
    "input_embeds": "give text or input_ids",
    "lora_path": "specctl serves the target's own weights, no LoRA adapter",
    "custom_logit_processor": "it would run code sent with the request; leave it out",
}
UNSERVED_SAMPLING = {
    "structural_tag": "give json_schema, regex or ebnf",
}


def refuse_unserved(asked: "GenerateRequest") -> None:
    for name, instead in UNSERVED.items():
        if getattr(asked, name) is not None:
            raise ApiError(400, f"{name} is not served here: {instead}", param=name)
    for name, instead in UNSERVED_SAMPLING.items():
        if getattr(asked.sampling_params, name) is not None:
            raise ApiError(400, f"sampling_params.{name} is not served here: {instead}", param="sampling_params")


def parse_generate(body: bytes, tokenizer: Any, context: int, model: str) -> tuple[CompletionRequest, "SglangReply"]:
    """A /generate body as the completion request it amounts to, and what answers it."""
    started = time.perf_counter()
    asked = parse_body(body, GenerateRequest)
    refuse_unserved(asked)
    if (asked.text is None) == (asked.input_ids is None):
        raise ApiError(400, "give text or input_ids (one of them)", param="text")
    scored = asked.return_logprob and asked.logprob_start_len >= 0
    if scored and asked.stream:
        raise ApiError(400, "the input's logprobs (logprob_start_len >= 0) are answered whole here: send stream "
                            "false, or logprob_start_len -1 for the output's alone", param="logprob_start_len")
    given = asked.text if asked.text is not None else asked.input_ids
    batch = isinstance(given, list) and bool(given) and isinstance(given[0], (str, list))
    if batch and not all(isinstance(p, type(given[0])) for p in given) or (
            not batch and isinstance(given, list) and not all(isinstance(p, int) for p in given)):
        raise ApiError(400, "input_ids is one prompt's token ids or a list of them", param="input_ids")
    for p in given if batch else [given]:
        if isinstance(p, str):
            check_prompt_chars(len(p), tokenizer, context, "text")
    prompts = [encode_prompt(tokenizer, p) if isinstance(p, str) else p for p in (given if batch else [given])]
    if not all(prompts):
        raise ApiError(400, "the prompt is empty", param="text" if asked.text is not None else "input_ids")
    s = asked.sampling_params
    try:
        schema = None if s.json_schema is None else json.loads(s.json_schema)
    except ValueError as exc:
        raise ApiError(400, f"sampling_params.json_schema is not JSON: {exc}", param="sampling_params") from None
    room = max(1, context - max(map(len, prompts)))  # max_new_tokens null: to the end of the context
    req = CompletionRequest(
        model=asked.model, prompt=prompts if batch else prompts[0],
        max_tokens=room if s.max_new_tokens is None else max(1, s.max_new_tokens), temperature=s.temperature,
        top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, stop=s.stop, stop_token_ids=s.stop_token_ids, n=s.n,
        frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
        repetition_penalty=s.repetition_penalty, min_tokens=s.min_new_tokens, guided_json=schema,
        guided_regex=s.regex, guided_grammar=s.ebnf, ignore_eos=s.ignore_eos,
        skip_special_tokens=s.skip_special_tokens, include_stop_str_in_output=s.no_stop_trim, stop_regex=s.stop_regex,
        logit_bias=s.logit_bias, seed=s.sampling_seed, stream=asked.stream, request_id=asked.rid,
        logprobs=asked.top_logprobs_num if asked.return_logprob else None,
        prompt_logprobs=asked.top_logprobs_num if scored else None)
    text = (lambda token: tokenizer.decode([token])) if asked.return_text_in_logprobs else (lambda _token: None)
    logprobs = Logprobs(asked.logprob_start_len if scored else None, text) if asked.return_logprob else None
    if s.max_new_tokens is not None and s.max_new_tokens < 0:
        raise ApiError(400, f"max_new_tokens must be at least 0, got {s.max_new_tokens}", param="sampling_params")
    return req, SglangReply([len(p) for p in prompts], s.n, batch or s.n > 1, started, logprobs,
                            s.max_new_tokens == 0)


@dataclass(slots=True)
class SglangReply:
    """SGLang's answer from a request's choices: one output, a list of them, or server-sent
    events of the text so far ending with ``[DONE]``."""
    prompt_tokens: list[int]  # each prompt's length
    n: int  # choices per prompt: choice index i * n + j is prompt i's
    listed: bool  # a batch or n > 1: a list of outputs
    started: float
    logprobs: "Logprobs | None" = None  # return_logprob: the target's, in meta_info
    evaluate_only: bool = False  # max_new_tokens 0: the prompt read (its logprobs, the prefix cache), nothing out

    async def collect(self, choices: Choices) -> web.Response:
        outputs: dict[int, dict] = {}
        scores: dict[int, Scores] = {}
        async for index, event in choices.events():
            output = outputs.setdefault(index, {"text": "", "output_ids": []})
            self._add(output, scores.setdefault(index, Scores()), event)
            if event.finish:
                output["meta_info"] = self._meta(index, event, choices.request_id, scores[index])
        answer = [outputs[i] for i in sorted(outputs)]
        return await json_answer(lambda: answer if self.listed else answer[0])

    async def stream(self, request: web.Request, choices: Choices) -> web.StreamResponse:
        response = await event_stream(request)
        outputs: dict[int, dict] = {}
        scores: dict[int, Scores] = {}
        try:
            async for index, event in choices.events():
                output = outputs.setdefault(index, {"index": index, "text": "", "output_ids": []})
                self._add(output, scores.setdefault(index, Scores()), event)
                if (event.delta or event.tokens) and not self.evaluate_only or event.finish:
                    meta = self._meta(index, event, choices.request_id, scores[index])
                    await response.write(_event({**output, "meta_info": meta}))
        except (RemoteError, ApiError) as exc:  # the headers are gone: the error travels in the stream
            error = stream_failure(exc)
            await response.write(_event({"error": {"message": str(error), "code": error.status}}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _add(self, output: dict, scores: "Scores", event: Event) -> None:
        scores.prompt += event.prompt or []
        if not self.evaluate_only:  # max_new_tokens 0: the one token run is not handed out
            output["text"] += event.delta
            output["output_ids"] += event.tokens
            scores.output += event.logprobs

    def _meta(self, index: int, event: Event, request_id: str, scores: "Scores") -> dict:
        """meta_info: finish_reason null until the last event, which has the generation's figures;
        the logprobs so far where asked."""
        meta = {"id": request_id if len(self.prompt_tokens) * self.n == 1 else f"{request_id}-{index}",
                "finish_reason": None, "prompt_tokens": self.prompt_tokens[index // self.n],
                "completion_tokens": 0 if self.evaluate_only else event.count}
        if self.logprobs is not None:
            meta.update(self.logprobs.fields(scores))
        if not event.finish:
            return meta
        if event.finish == "length" or self.evaluate_only:
            meta["finish_reason"] = {"type": "length", "length": meta["completion_tokens"]}
        elif event.finish == "stop":
            matched = event.stop_reason if isinstance(event.stop_reason, str) else event.stop_token
            meta["finish_reason"] = {"type": "stop", "matched": matched}
        else:
            meta["finish_reason"] = {"type": "abort", "message": event.finish}
        stats, drafts = event.stats, event.stats.get("drafts", 0)
        return {**meta, "cached_tokens": stats.get("cached_prompt_tokens", 0),
                "e2e_latency": round(time.perf_counter() - self.started, 6),
                "spec_verify_ct": stats.get("rounds", 0), "spec_num_proposed_drafts": stats.get("drafted", 0),
                "spec_num_correct_drafts": stats.get("accepted", 0),
                "spec_accept_length": round(1 + stats.get("accepted", 0) / drafts, 4) if drafts else 0.0,
                "spec_accept_rate": stats.get("acceptance_rate", 0.0)}


@dataclass(slots=True)
class Scores:
    """One output's logprob entries so far (R.TokenLogprob): the prompt's, then the output's."""
    prompt: list = field(default_factory=list)
    output: list = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Logprobs:
    """SGLang's logprob fields: ``[logprob, token id, text or None]`` per token, the
    alternatives likewise; the input's from ``start`` (None: not asked)."""
    start: int | None
    text: Callable[[int], str | None]

    def fields(self, scores: Scores) -> dict:
        body = {"output_token_logprobs": [self._entry(e.logprob, e.token) for e in scores.output],
                "output_top_logprobs": [self._alternatives(e) for e in scores.output]}
        if self.start is not None:
            kept = scores.prompt[self.start:]
            body["input_token_logprobs"] = [self._entry(e.logprob, e.token) for e in kept]
            body["input_top_logprobs"] = [self._alternatives(e) if e.logprob is not None else None for e in kept]
        return body

    def _entry(self, logprob: float | None, token: int) -> list:
        return [logprob, token, self.text(token)]

    def _alternatives(self, entry) -> list:
        return [self._entry(lp, token) for token, lp in zip(entry.top_ids, entry.top_logprobs)]


def _event(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()
