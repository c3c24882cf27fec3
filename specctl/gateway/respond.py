"""A request's choices become its answer: one JSON body (collected) or an SSE stream, with
each choice's logprobs, with a reasoning parser its thinking apart (gateway.reasoning) and,
when the request gave tools, its answer read for tool calls (gateway.tool_calls: the Hermes
blocks of a free output, or a forced call's JSON; streamed, a call's name as soon as it is read
and its arguments as they come)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import msgspec
from aiohttp import web

from specctl.gateway import responses as R
from specctl.gateway.keepalive import event_stream
from specctl.gateway.api import ApiError
from specctl.gateway.choices import Choices
from specctl.gateway.reasoning import reasoning_reader, split_reasoning
from specctl.gateway.tool_calls import read_whole
from specctl.verify.client import RemoteError


JSON_PIECE = 256  # items of a long list encoded at once (json_in_pieces)


def remote_message(exc: RemoteError) -> str:
    """A target instance's error as the client reads it: said to come from the target, once."""
    message = str(exc)
    return message if message.startswith("target instance") else f"target instance: {message}"


def stream_failure(exc: RemoteError | ApiError) -> ApiError:
    """A failure after a stream's headers, which each reply sends in its own shape: an ApiError
    as it is (a choice that waited its turn found none, gateway.choices; a stream that could not
    start after its keep-alive headers, gateway.keepalive), a target's error as a 502."""
    return exc if isinstance(exc, ApiError) else ApiError(502, remote_message(exc), type="server_error")


@dataclass(slots=True)
class Reply:
    model: str
    chat: bool
    prompt_tokens: int
    logprobs: Callable[[list, int], dict] | None  # (entries, text offset) -> OpenAI's logprobs; None: not asked
    calls: Callable[[], Any] | None = None  # a reader of one choice's tool calls (gateway.tool_calls); None: no tools
    include_usage: bool = False  # streamed: a last chunk with the usage
    continuous_usage: bool = False  # streamed: every chunk with the usage so far too (vLLM's continuous_usage_stats)
    n: int = 1  # choices per prompt (a prompt's cached tokens are counted once)
    # entries -> vLLM's prompt_logprobs (a completion choice's; chat's at the top, its one prompt's); None: not asked
    prompt_logprobs: Callable[[list], list] | None = None
    request_id: str | None = None  # names the answer (gateway.request_id); None: a fresh id
    text_length: Callable[[int], int] | None = None  # a token id's text length (streamed completions' text_offset)
    thinking: bool | None = None  # chat with a reasoning parser: whether the output starts in thought; None: no parser
    include_reasoning: bool = True  # vLLM's include_reasoning: false leaves the thinking out
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's and each choice's token ids too
    predicted: bool = False  # the request gave a prediction: usage counts its accepted and rejected tokens

    def _predicted(self, choices: Choices, outputs: dict[int, list[int]]) -> dict | None:
        """usage's completion_tokens_details when the request gave a prediction (every choice's)."""
        return R.prediction_details(choices.specs[0].params.prediction, outputs.values()) if self.predicted else None

    async def collect(self, choices: Choices) -> web.Response:
        events: dict[int, list] = {}
        ended: list[int] = []  # the choices in the order they finished
        async for index, event in choices.events():
            events.setdefault(index, []).append(event)
            if event.finish:
                ended.append(index)
        return await json_answer(partial(self._whole, choices, events, ended))

    def _whole(self, choices: Choices, events: dict[int, list], ended: list[int]) -> dict:
        """The whole answer from each choice's events."""
        texts: dict[int, list[str]] = {}
        entries: dict[int, list[R.TokenLogprob]] = {}
        tokens: dict[int, list[int]] = {}
        outputs: dict[int, list[int]] = {}  # usage's: without the EOS or stop token that ended a choice
        bodies, stats, prompts = [], {}, {}
        for index, event in ((index, event) for index in ended for event in events[index]):
            if event.prompt is not None and self.prompt_logprobs:
                prompts[index] = self.prompt_logprobs(event.prompt)
            texts.setdefault(index, []).append(event.delta)
            entries.setdefault(index, []).extend(event.logprobs)
            tokens.setdefault(index, []).extend(ended_tokens(event))
            outputs.setdefault(index, []).extend(event.tokens)
            if event.finish:
                text, calls, finish, thought = "".join(texts[index]), None, event.finish, ()
                if self.thinking is not None:
                    reasoning, text = split_reasoning(text, self.thinking)
                    thought = (reasoning if self.include_reasoning else None,)
                if self.calls is not None and text is not None:
                    reader = self.calls()
                    content, calls = read_whole(reader, text)
                    if calls:  # content beside calls: None when there is none, as OpenAI's
                        text, finish = content if content.strip() else None, reader.finish_reason
                bodies.append(R.choice(self.chat, index, text, finish,
                                       self.logprobs(entries[index], 0) if self.logprobs else None, calls, thought,
                                       event.stop_reason))
                if self.prompt_logprobs and not self.chat:
                    bodies[-1]["prompt_logprobs"] = prompts.get(index)
                if self.token_ids:
                    if not self.chat:
                        bodies[-1]["prompt_token_ids"] = prompt_ids(choices, index)
                    bodies[-1]["token_ids"] = tokens[index]
                stats[index] = event.stats
        body = R.full_response(R.new_id(self.chat, self.request_id), self.model, self.chat, bodies, self.prompt_tokens,
                               choices.completion_tokens, R.spec_summaries(list(stats.values())),
                               cached=R.cached_tokens(stats, self.n), predicted=self._predicted(choices, outputs))
        if self.prompt_logprobs and self.chat:  # vLLM's place for chat: one prompt, beside the choices
            body["prompt_logprobs"] = prompts.get(min(prompts, default=0))
        if self.token_ids and self.chat:
            body["prompt_token_ids"] = choices.specs[0].prompt
        return body

    async def stream(self, request: web.Request, choices: Choices) -> web.StreamResponse:
        rid, created, model, chat = R.new_id(self.chat, self.request_id), int(time.time()), self.model, self.chat
        response = await event_stream(request)

        unsent: dict[int, list[int]] = {}  # return_token_ids: each choice's tokens not yet in a chunk

        async def send(big: bool = False, **fields) -> None:
            if self.continuous_usage:  # the chunk's choice's, as vLLM's (the last chunk has the request's)
                fields["extra"] = {**(fields.get("extra") or {}), "usage": R.usage(*choices.usage_of(fields["index"]))}
            body = R.chunk(rid, model, chat, created, **fields,
                           token_ids=unsent.pop(fields["index"], []) if self.token_ids else None)
            if self.token_ids and not chat and fields["index"] not in prompted:  # a choice's first chunk
                prompted.add(fields["index"])
                body["choices"][0]["prompt_token_ids"] = prompt_ids(choices, fields["index"])
            await response.write(await sse_off_loop(body) if big else R.sse(body))

        prompted: set[int] = set()
        if chat:
            for k, spec in enumerate(choices.specs):
                await send(role=True, index=spec.index,
                           extra={"prompt_token_ids": spec.prompt} if self.token_ids and not k else None)
        offsets: dict[int, int] = {}  # each choice's text handed out so far (completions' text_offset)
        calls = {spec.index: self.calls() for spec in choices.specs} if self.calls is not None else {}
        thoughts = ({spec.index: reasoning_reader(self.thinking) for spec in choices.specs}
                    if self.thinking is not None else {})
        stats, outputs = {}, {}
        try:
            async for index, event in choices.events():
                if event.prompt_progress is not None:  # llama.cpp's shape: an empty delta beside it
                    await send(index=index, extra={"prompt_progress": event.prompt_progress})
                    continue
                unsent.setdefault(index, []).extend(ended_tokens(event))  # sent with the event's first chunk
                outputs.setdefault(index, []).extend(event.tokens)
                thought, text = thoughts[index].push(event.delta) if thoughts else ("", event.delta)
                delta, call_deltas = calls[index].push(text) if calls else (text, [])
                listed = False  # the event's logprobs sent with its thinking
                if thought and self.include_reasoning:
                    listed = bool(self.logprobs and event.logprobs)
                    await send(reasoning=thought, logprobs=self.logprobs(event.logprobs, 0) if listed else None,
                               index=index)
                if delta or (self.logprobs and event.logprobs and not listed):
                    # an echoed prompt's logprobs are the one long list a chunk may hold: off the loop
                    big = len(event.logprobs) > JSON_PIECE
                    logprobs = None
                    if self.logprobs and not listed:
                        logprobs = (await asyncio.to_thread(self.logprobs, event.logprobs, offsets.get(index, 0))
                                    if big else self.logprobs(event.logprobs, offsets.get(index, 0)))
                    if logprobs and not chat and logprobs["tokens"]:  # the next chunk's tokens start after these
                        offsets[index] = logprobs["text_offset"][-1] + self.text_length(event.logprobs[-1].token)
                    await send(big, text=delta, logprobs=logprobs, index=index)
                for chunk in call_chunks(call_deltas):
                    await send(tool_calls=chunk, index=index)
                if event.finish:
                    finish = event.finish
                    thought = thoughts[index].finish() if thoughts else ""
                    if thought and self.include_reasoning:
                        await send(reasoning=thought, index=index)
                    if calls:
                        rest, call_deltas, found = calls[index].finish()
                        if rest:
                            await send(text=rest, index=index)
                        for chunk in call_chunks(call_deltas):
                            await send(tool_calls=chunk, index=index)
                        if found:
                            finish = calls[index].finish_reason
                    stats[index] = event.stats
                    await send(finish_reason=finish, stop_reason=event.stop_reason,
                               extra={"specctl": R.spec_summary(event.stats)}, index=index)
            if self.include_usage:
                await response.write(R.sse(R.usage_chunk(rid, model, chat, created, self.prompt_tokens,
                                                         choices.completion_tokens, R.cached_tokens(stats, self.n),
                                                         self._predicted(choices, outputs))))
        except (RemoteError, ApiError) as exc:  # headers are gone: the error travels in the stream, as vLLM's
            await response.write(R.sse(stream_failure(exc).body()))
        await response.write(R.sse("[DONE]"))
        await response.write_eof()
        return response


async def json_answer(build: Callable[[], Any]) -> web.Response:
    """A whole answer: ``build()``'s JSON, built and serialised off the event loop every stream
    is read on (a long prompt's prompt_logprobs with 20 alternatives each is tens of MB of
    JSON: 1.9 s at 32k tokens), each long list a piece at a time (json_in_pieces)."""
    return web.Response(body=await asyncio.to_thread(lambda: json_in_pieces(build())), content_type="application/json",
                        charset="utf-8")


async def sse_off_loop(body: Any) -> bytes:
    """R.sse's event, its JSON built on a worker thread (json_in_pieces): a body that lists
    every token's logprobs."""
    return b"data: " + await asyncio.to_thread(json_in_pieces, body) + b"\n\n"


def json_in_pieces(value: Any) -> bytes:
    """``value``'s JSON, each long list encoded a piece at a time: an encoder holds the GIL
    until it returns, and a piece is milliseconds where tens of MB at once (a long prompt's
    prompt_logprobs) kept the event loop waiting for a quarter of a second (msgspec's; json's
    took six times as long)."""
    return msgspec.json.encode(_pieces(value))


def _pieces(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _pieces(item) for key, item in value.items()}
    if not isinstance(value, list):
        return value
    if len(value) <= JSON_PIECE:
        return [_pieces(item) for item in value]
    return msgspec.Raw(b"[" + b",".join(msgspec.json.encode(value[i:i + JSON_PIECE])[1:-1]
                                        for i in range(0, len(value), JSON_PIECE)) + b"]")


def ended_tokens(event) -> list[int]:
    """An event's token ids, with the EOS or stop token that ended its choice (vLLM's token_ids
    hold it; the text and usage leave it out)."""
    return [*event.tokens, *(() if event.stop_token is None else (event.stop_token,))]


def prompt_ids(choices: Choices, index: int) -> list[int]:
    return next(spec.prompt for spec in choices.specs if spec.index == index)


def whole_answer(text: str, thinking: bool | None, calls: Callable[[], Any] | None) -> tuple[str | None, str, list | None]:
    """A finished choice's whole text as (its thinking, the answer's text, its tool calls): the
    thinking apart with a reasoning parser (``thinking``: whether the output starts in thought),
    the calls read back by a new ``calls`` reader when the request gave tools."""
    thought = found = None
    if thinking is not None:
        thought, text = split_reasoning(text, thinking)
        text = text or ""
    if calls is not None:
        text, found = read_whole(calls(), text)
    return thought, text, found


def call_chunks(deltas: list[dict]) -> list[list[dict]]:
    """A push's tool-call deltas as the chunks to send, none holding two entries of one call, as
    OpenAI streams them (a call's id and name, then its arguments): a reader hands out a call's
    first delta and its arguments' first piece together when one push reads both (a speculative
    round's tokens often do), and clients that read a chunk's entries by index (instructor's
    partial objects) kept one of the two."""
    chunks: list[list[dict]] = []
    for delta in deltas:
        if not chunks or any(sent["index"] == delta["index"] for sent in chunks[-1]):
            chunks.append([])
        chunks[-1].append(delta)
    return chunks
