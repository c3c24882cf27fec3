"""An Anthropic Messages answer (gateway.anthropic_api): a message whose content is a
``thinking`` block (with a reasoning parser), a ``text`` block and a ``tool_use`` block per call,
with ``stop_reason`` end_turn, max_tokens, stop_sequence (and which) or tool_use — whole, or
streamed as Anthropic's events: message_start, a ping (as Anthropic's stream sends one), then per
block content_block_start, its
text_delta / thinking_delta / input_json_delta events and content_block_stop, then
message_delta (the stop reason and the output tokens) and message_stop; an ``error`` event when
a target fails mid-stream."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, ClassVar

from aiohttp import web

from specctl.gateway import responses as R
from specctl.gateway.keepalive import event_stream
from specctl.gateway.api import ApiError
from specctl.gateway.anthropic_api import error_body
from specctl.gateway.choices import Choices, Event
from specctl.gateway.reasoning import reasoning_reader
from specctl.gateway.respond import json_answer, stream_failure, whole_answer
from specctl.verify.client import RemoteError


def stop_of(event: Event, calls: list | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if calls:
        return "tool_use", None
    if event.finish == "length":
        return "max_tokens", None
    if isinstance(event.stop_reason, str):  # a stop string
        return "stop_sequence", event.stop_reason
    return "end_turn", None


def tool_use_id(call_id: str) -> str:
    """A chat call's id as Anthropic spells a tool_use block's (``toolu_`` where chat has ``call_``):
    clients and logs that check the prefix see Anthropic's (anthropic_api.chat_call_id takes it off)."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_use(call: dict) -> dict:
    """A chat tool call (gateway.tool_calls) as a tool_use block, its arguments as the object."""
    try:
        arguments = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:  # a reader hands out JSON arguments; kept whole if one did not
        arguments = {"arguments": call["function"]["arguments"]}
    return {"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"], "input": arguments}


@dataclass(slots=True)
class AnthropicReply:
    model: str
    prompt_tokens: int
    calls: Callable[[], Any] | None = None  # a reader of the tool calls (gateway.tool_calls); None: no tools
    thinking: bool | None = None  # with a reasoning parser: whether the output starts in thought; None: no parser
    show_thinking: bool = True  # False: thinking blocks without their text (thinking.display "omitted")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    opened: bool = False  # message_start sent

    def usage(self, count: int, stats: dict | None) -> dict:
        """Anthropic's usage: its input_tokens are the prompt's tokens not read from the cache
        (the prompt is input_tokens + cache_read_input_tokens + cache_creation_input_tokens)."""
        cached = R.cached_tokens({0: stats}, 1) if stats else 0
        return {"input_tokens": self.prompt_tokens - cached, "output_tokens": count,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def message(self, content: list[dict], stop: tuple[str | None, str | None], count: int,
                stats: dict | None) -> dict:
        body = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": self.usage(count, stats)}
        if stats:
            body["specctl"] = R.spec_summary(stats)
        return body

    async def collect(self, choices: Choices) -> web.Response:
        pieces = []
        async for _, event in choices.events():
            pieces.append(event.delta)
            if event.finish:  # read back, built and serialised off the event loop, as every whole answer
                return await json_answer(lambda: self._whole("".join(pieces), event))
        raise RuntimeError("a generation ended without its last event")  # Choices always ends with one

    def _whole(self, output: str, event: Event) -> dict:
        """A finished output's message: its thinking, text and tool_use blocks."""
        thought, text, calls = whole_answer(output, self.thinking, self.calls)
        shown = thought if self.show_thinking else ""
        content = [{"type": "thinking", "thinking": shown, "signature": ""}] if thought else []
        if text.strip() or not (calls or thought):
            content.append({"type": "text", "text": text})
        content += [tool_use(call) for call in calls or []]
        return self.message(content, stop_of(event, calls), event.count, event.stats)

    # what a stream waiting for its first token sends every few seconds (gateway.keepalive):
    # Anthropic's ping, which its clients' watchdogs count (Claude Code's ends a stream with
    # no event for 300 s), after the message_start that must come first
    KEEPALIVE: ClassVar[bytes] = b"event: ping\n" + R.sse({"type": "ping"})

    async def open(self, response: web.StreamResponse) -> None:
        """The stream's opening: message_start and a ping, once (early, for a stream that waits)."""
        if not self.opened:
            self.opened = True
            await response.write(b"event: message_start\n"
                                 + R.sse({"type": "message_start", "message": self.message([], (None, None), 0, None)})
                                 + self.KEEPALIVE)

    async def stream(self, request: web.Request, choices: Choices) -> web.StreamResponse:
        response = await event_stream(request)

        async def send(kind: str, **fields) -> None:
            await response.write(f"event: {kind}\n".encode() + R.sse({"type": kind, **fields}))

        await self.open(response)
        blocks = StreamedBlocks(send, self.show_thinking)
        reader = self.calls() if self.calls is not None else None
        thoughts = reasoning_reader(self.thinking) if self.thinking is not None else None
        try:
            async for _, event in choices.events():
                thought, text = thoughts.push(event.delta) if thoughts is not None else ("", event.delta)
                await blocks.think(thought)
                await blocks.add(*(reader.push(text) if reader is not None else (text, [])))
                if event.finish:
                    await blocks.think(thoughts.finish() if thoughts is not None else "")
                    rest, deltas, calls = reader.finish() if reader is not None else ("", [], None)
                    await blocks.add(rest, deltas)
                    await blocks.close()
                    stop_reason, stop_sequence = stop_of(event, calls)
                    await send("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                               usage=self.usage(event.count, event.stats))  # the cache's share known now
                    await send("message_stop")
        except (RemoteError, ApiError) as exc:  # headers are gone: the failure travels in the stream, as Anthropic's
            await send("error", error=error_body(stream_failure(exc))["error"])
        await response.write_eof()
        return response


class StreamedBlocks:
    """A streamed message's content blocks, each opened when its kind of delta comes and closed
    by the next: thinking, text, then a tool_use block per call (its arguments as JSON pieces).
    Whitespace waits for text after it (what only separates thinking from a call opens no text
    block, as a whole answer has none); a message with no content gets one empty text block."""

    def __init__(self, send: Callable[..., Awaitable[None]], show_thinking: bool = True) -> None:
        self.send, self.show_thinking = send, show_thinking
        self.index = -1  # the open (or last) block's index
        self.open: str | None = None  # its type
        self.blank = ""  # whitespace not sent yet

    async def think(self, thought: str) -> None:
        if thought:
            if self.open != "thinking":
                await self._start({"type": "thinking", "thinking": "", "signature": ""})
            if self.show_thinking:
                await self._delta({"type": "thinking_delta", "thinking": thought})

    async def add(self, content: str, deltas: list[dict]) -> None:
        if content and not content.strip() and self.open != "text":
            self.blank += content
        elif content:
            if self.open != "text":
                await self._start({"type": "text", "text": ""})
            text, self.blank = self.blank + content, ""
            await self._delta({"type": "text_delta", "text": text})
        for delta in deltas:
            if "id" in delta:  # a call begins
                await self._start({"type": "tool_use", "id": tool_use_id(delta["id"]),
                                   "name": delta["function"]["name"], "input": {}})
            if delta["function"].get("arguments"):
                await self._delta({"type": "input_json_delta", "partial_json": delta["function"]["arguments"]})

    async def close(self) -> None:
        if self.index < 0:
            await self._start({"type": "text", "text": ""})
        await self._end()

    async def _end(self) -> None:
        if self.open is not None:
            await self.send("content_block_stop", index=self.index)
            self.open = None

    async def _start(self, block: dict) -> None:
        await self._end()
        self.index += 1
        self.open = block["type"]
        await self.send("content_block_start", index=self.index, content_block=block)

    async def _delta(self, delta: dict) -> None:
        await self.send("content_block_delta", index=self.index, delta=delta)
