"""A Responses API answer (gateway.responses_api): the response object, whose output is the
assistant's message and its ``function_call`` items — after a ``reasoning`` item with the
thinking when the gateway has a reasoning parser (gateway.reasoning) —, whole or streamed as the
Responses events — response.created, response.in_progress, then per output item its ``added``
event, its text, thinking or arguments deltas and its ``done`` events, then response.completed
(or response.incomplete when max_output_tokens cut it; response.failed when a target fails
mid-stream)."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import msgspec
from aiohttp import web

from specctl.gateway import responses as R
from specctl.gateway.api import ApiError
from specctl.gateway.keepalive import event_stream
from specctl.gateway.choices import Choices
from specctl.gateway.reasoning import reasoning_reader
from specctl.gateway.respond import json_answer, sse_off_loop, stream_failure, whole_answer
from specctl.verify.client import RemoteError


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# a stream's events that carry the whole message so far (with logprobs asked, every token's)
WHOLE_EVENTS = (".done", ".completed", ".incomplete")


def text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(item_id: str, text: str, status: str, logprobs: list[dict] | None = None) -> dict:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [text_part(text, logprobs)]}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    """The thinking as OpenAI's reasoning item: its text as one reasoning_text part, no summary."""
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None}


def call_item(item_id: str, call: dict, status: str) -> dict:
    """A chat tool call (gateway.tool_calls) as a Responses function_call item."""
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def status_of(finish: str, calls: list | None) -> str:
    return "completed" if calls or finish != "length" else "incomplete"


@dataclass(slots=True)
class ResponsesReply:
    model: str
    prompt_tokens: int
    req: Any  # gateway.responses_api.ResponsesRequest
    calls: Callable[[], Any] | None = None  # a reader of the tool calls (gateway.tool_calls); None: no tools
    keep: Callable[[dict], None] | None = None  # stores the finished response's body; None: not stored
    logprobs: Callable[[list], list[dict]] | None = None  # tokens' entries -> output_text logprobs; None: not asked
    thinking: bool | None = None  # with a reasoning parser: whether the output starts in thought; None: no parser
    count_tokens: Callable[[str], int] = len  # a text's tokens (the thinking's, for usage's reasoning_tokens)
    rid: str = field(default_factory=lambda: _id("resp"))
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict], count: int = 0, stats: dict | None = None,
             error: dict | None = None, thought_tokens: int = 0) -> dict:
        """The response object (no usage while in progress)."""
        fmt = self.req.text.format if self.req.text is not None and self.req.text.format is not None else None
        body = {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": self.req.instructions, "max_output_tokens": self.req.max_output_tokens,
            "temperature": 1.0 if self.req.temperature is None else self.req.temperature,
            "top_p": 1.0 if self.req.top_p is None else self.req.top_p,
            "parallel_tool_calls": self.req.parallel_tool_calls,
            "tool_choice": self.req.tool_choice if self.req.tool_choice is not None else "auto",
            "tools": self.req.tools or [],
            "text": {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}},
            "top_logprobs": self.req.top_logprobs or 0, "previous_response_id": self.req.previous_response_id,
            "store": self.keep is not None, "truncation": "disabled",
            "reasoning": msgspec.to_builtins(self.req.reasoning) if self.req.reasoning is not None else None,
            "metadata": self.req.metadata or {}, "user": self.req.user,
            "usage": None if stats is None else self._usage(count, stats, thought_tokens),
        }
        if stats is not None:
            body["specctl"] = R.spec_summary(stats)
        return body

    def _usage(self, count: int, stats: dict, thought_tokens: int) -> dict:
        return {"input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": R.cached_tokens({0: stats}, 1)},
                "output_tokens": count, "output_tokens_details": {"reasoning_tokens": thought_tokens},
                "total_tokens": self.prompt_tokens + count}

    def _finished(self, status: str, output: list[dict], count: int, stats: dict) -> dict:
        """The finished response's body, stored first when it is kept (a failed one is not); its
        reasoning tokens counted from the thinking's text, as the tokenizer encodes it."""
        thought = "".join(part["text"] for item in output if item["type"] == "reasoning" for part in item["content"])
        body = self.body(status, output, count, stats, thought_tokens=self.count_tokens(thought) if thought else 0)
        if self.keep is not None:
            self.keep(body)
        return body

    async def collect(self, choices: Choices) -> web.Response:
        pieces, entries = [], []
        async for _, event in choices.events():
            pieces.append(event.delta)
            entries.extend(event.logprobs)
            if event.finish:
                # read back and built off the event loop, as every whole answer (respond.json_answer:
                # a long output's top_logprobs are MBs); stored on the loop, which reads the store
                status, output = await asyncio.to_thread(self._output, "".join(pieces), entries, event.finish)
                body = self._finished(status, output, event.count, event.stats)
                return await json_answer(lambda: body)
        raise RuntimeError("a generation ended without its last event")  # Choices always ends with one

    def _output(self, whole: str, entries: list, finish: str) -> tuple[str, list[dict]]:
        """A finished output's (status, output items)."""
        thought, text, calls = whole_answer(whole, self.thinking, self.calls)
        status = status_of(finish, calls)
        logprobs = self.logprobs(entries) if self.logprobs is not None else None
        # the thinking is complete once the answer (or a call) began, as a stream closes it then
        output = [reasoning_item(_id("rs"), thought, "completed" if text or calls else status)] if thought else []
        if not (calls and not text.strip()) and not (thought and not text):
            output.append(message_item(_id("msg"), text, status, logprobs))
        output += [call_item(_id("fc"), call, "completed") for call in calls or []]
        return status, output

    async def stream(self, request: web.Request, choices: Choices) -> web.StreamResponse:
        response = await event_stream(request)
        sequence = 0

        async def send(kind: str, **fields) -> None:
            nonlocal sequence
            event = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            if self.logprobs is not None and kind.endswith(WHOLE_EVENTS):  # every token's logprobs: off the loop
                await response.write(f"event: {kind}\n".encode() + await sse_off_loop(event))
            else:
                await response.write(f"event: {kind}\n".encode() + R.sse(event))

        await send("response.created", response=self.body("in_progress", []))
        await send("response.in_progress", response=self.body("in_progress", []))
        items = StreamedItems(send)
        reader = self.calls() if self.calls is not None else None
        thoughts = reasoning_reader(self.thinking) if self.thinking is not None else None
        try:
            async for _, event in choices.events():
                thought, text = thoughts.push(event.delta) if thoughts is not None else ("", event.delta)
                await items.think(thought)
                content, deltas = reader.push(text) if reader is not None else (text, [])
                await items.add(content, deltas, self.logprobs(event.logprobs) if self.logprobs is not None else [])
                if event.finish:
                    await items.think(thoughts.finish() if thoughts is not None else "")
                    rest, deltas, calls = reader.finish() if reader is not None else ("", [], None)
                    await items.add(rest, deltas)
                    status = status_of(event.finish, calls)
                    output = await items.close(status)
                    body = self._finished(status, output, event.count, event.stats)
                    await send(f"response.{status}", response=body)
        except (RemoteError, ApiError) as exc:  # headers are gone: the failure travels in the stream, as OpenAI's
            failure = stream_failure(exc)
            error = {"code": failure.code or "server_error", "message": str(failure)}
            await send("response.failed", response=self.body("failed", items.done, error=error))
        await response.write_eof()
        return response


class StreamedItems:
    """The output items of a streamed response, opened and closed as thinking, text and call
    deltas come: the reasoning item while thinking comes (closed by the answer's first text or
    call), the message while text comes (closed by the first call), each call until the next begins.
    Tokens' logprobs go with the next text delta (a token whose text is held back waits for it);
    the message's done events carry them all — up to the first call's: a whole answer with calls
    lists every token's on its message, as chat's logprobs do."""

    def __init__(self, send: Callable[..., Awaitable[None]]) -> None:
        self.send = send
        self.done: list[dict] = []  # items closed, in output order
        self.text: list[str] | None = None  # the open message's text
        self.thought: list[str] | None = None  # the open reasoning item's text
        self.reasoning_id = _id("rs")
        self.call: tuple[dict, list[str]] | None = None  # the open call's item and arguments
        self.message_id = _id("msg")
        self.logprobs: list[dict] = []  # the message's tokens' logprobs sent with its deltas
        self.pending: list[dict] = []  # those of tokens whose text has not been sent yet

    async def think(self, thought: str) -> None:
        if not thought:
            return
        if self.thought is None:
            self.thought = []
            await self.send("response.output_item.added", output_index=len(self.done),
                            item={**reasoning_item(self.reasoning_id, "", "in_progress"), "content": []})
        self.thought.append(thought)
        await self.send("response.reasoning_text.delta", item_id=self.reasoning_id, output_index=len(self.done),
                        content_index=0, delta=thought)

    async def add(self, content: str, deltas: list[dict], logprobs: list[dict] = ()) -> None:
        if self.call is None:  # the tokens of a call's text are not the message's
            self.pending.extend(logprobs)
        if self.thought is not None and (content or deltas):  # the answer begins: the thinking is complete
            await self._close_open("completed")
        if content:
            if self.text is None:
                await self._open_message()
            self.text.append(content)
            sent, self.pending = self.pending, []
            self.logprobs.extend(sent)
            await self.send("response.output_text.delta", **self._where(), delta=content, logprobs=sent)
        for delta in deltas:
            if "id" in delta:  # a call begins: what was open before it ends
                await self._close_open("completed")
                item = call_item(_id("fc"), {"id": delta["id"], "function": {**delta["function"], "arguments": ""}},
                                 "in_progress")
                self.call = item, []
                await self.send("response.output_item.added", output_index=len(self.done), item=item)
            if delta["function"].get("arguments"):
                item, arguments = self.call
                arguments.append(delta["function"]["arguments"])
                await self.send("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=len(self.done), delta=delta["function"]["arguments"])

    async def close(self, status: str) -> list[dict]:
        """Ends what is open (an empty message where nothing came) and returns every item."""
        if not self.done and self.text is None and self.call is None and self.thought is None:
            await self._open_message()
        await self._close_open(status)
        return self.done

    async def _open_message(self) -> None:
        self.text = []
        await self.send("response.output_item.added", output_index=len(self.done),
                        item={**message_item(self.message_id, "", "in_progress"), "content": []})
        await self.send("response.content_part.added", **self._where(), part=text_part(""))

    async def _close_open(self, status: str) -> None:
        index = len(self.done)
        if self.thought is not None:
            text, self.thought = "".join(self.thought), None
            await self.send("response.reasoning_text.done", item_id=self.reasoning_id, output_index=index,
                            content_index=0, text=text)
            self.done.append(reasoning_item(self.reasoning_id, text, status))
            await self.send("response.output_item.done", output_index=index, item=self.done[-1])
        elif self.text is not None:
            text, self.text = "".join(self.text), None
            logprobs, self.pending = self.logprobs + self.pending, []
            await self.send("response.output_text.done", **self._where(index), text=text, logprobs=logprobs)
            await self.send("response.content_part.done", **self._where(index), part=text_part(text, logprobs))
            self.done.append(message_item(self.message_id, text, status, logprobs))
            await self.send("response.output_item.done", output_index=index, item=self.done[-1])
        elif self.call is not None:
            (item, arguments), self.call = self.call, None
            item = {**item, "arguments": "".join(arguments), "status": "completed"}
            await self.send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"], name=item["name"])
            self.done.append(item)
            await self.send("response.output_item.done", output_index=index, item=item)

    def _where(self, index: int | None = None) -> dict:
        return {"item_id": self.message_id, "output_index": len(self.done) if index is None else index,
                "content_index": 0}
