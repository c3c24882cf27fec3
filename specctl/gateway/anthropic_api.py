"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the
chat path, as vLLM and llama.cpp serve it, so Anthropic's SDKs and tools written for them
(Claude Code's ANTHROPIC_BASE_URL among them) can run on the target's output: ``system``,
``messages`` (text, ``tool_use`` and ``tool_result`` blocks; an assistant turn's ``thinking``
blocks left out, as chat templates leave earlier thinking out; system messages among them, as
the beta mid-conversation-system sends them, rendered where they stand), ``tools`` (``input_schema``)
and ``tool_choice`` become a chat request, rendered by the chat template and read back for
tool calls; the answer (gateway.anthropic_reply) is a message whose content is thinking (with
a reasoning parser), text and ``tool_use`` blocks — whole, or streamed as Anthropic's events.

Choices made here: ``thinking`` ``enabled`` / ``between_tools`` / ``disabled`` turn the chat
template's ``enable_thinking`` on or off (Qwen3's), ``adaptive`` leaves the template's default;
``budget_tokens`` (with ``enabled``) is vLLM's ``thinking_token_budget``: the thinking is
ended after that many tokens where the gateway's reasoning parser knows its end (qwen3,
deepseek_r1; accepted and not enforced without one, as llama.cpp accepts it; Anthropic's floor
of 1024 is not held: small models think briefly), ``display: "omitted"`` sends thinking blocks
without their text.
``output_config.format`` (json_schema) holds the output to the schema, as response_format does
for chat; its ``effort`` changes nothing. temperature, top_p and top_k — which Anthropic's
newer clients no longer send — are taken as chat takes them (OpenAI's defaults when left out).
A last assistant message of text is the answer's beginning (Anthropic's prefill): the answer
goes on from it (vLLM's continue_final_message) and holds only what follows; its trailing
whitespace is kept, where Anthropic refuses it.
A max_tokens past the room the prompt leaves in the context is cut to that room (llama.cpp's
way; vLLM's 400 would end every Claude Code request, which asks for 32,000 tokens).
``cache_control`` marks are accepted and change nothing (prefix caching is automatic);
images, documents, built-in (server) tools and MCP servers are refused by name. The API key
comes as ``x-api-key`` or as a Bearer token; errors are Anthropic's
``{"type": "error", "error": {"type", "message"}}``."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import msgspec

from specctl.gateway.api import ApiError, CalledFunction, ChatCompletionRequest, ChatMessage, ResponseFormat, ToolCall

# thinking.type -> the chat template's enable_thinking (None: the template's default; adaptive: the model decides)
THINKING = {None: None, "enabled": True, "disabled": False, "adaptive": None, "between_tools": True}
# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class Block(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None  # tool_result
    content: str | list["Block"] | None = None
    is_error: bool = False
    thinking: str | None = None  # an earlier answer's thinking (left out)
    signature: str | None = None
    cache_control: Any = None


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Block]


class Thinking(msgspec.Struct, kw_only=True):
    type: str = "disabled"
    budget_tokens: int | None = None
    display: str | None = None  # "omitted": thinking blocks come without their text


class OutputFormat(msgspec.Struct, kw_only=True):
    type: str
    schema: dict[str, Any] | None = None


class OutputConfig(msgspec.Struct, kw_only=True):
    format: OutputFormat | None = None
    effort: str | None = None  # accepted; changes nothing here


class MessagesRequest(msgspec.Struct, kw_only=True):
    endpoint: ClassVar[str] = "/v1/messages"  # named in the log of fields it ignores
    messages: list[Message]
    model: str | None = None
    max_tokens: int | None = None  # required by /v1/messages, not by count_tokens
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None
    mcp_servers: Any = None  # refused
    seed: int | None = None  # extensions, as on chat (vLLM's)
    priority: int = 0


def error_body(exc: ApiError) -> dict:
    """An error as Anthropic's clients read it."""
    kind = ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": str(exc)}}


def as_chat(req: MessagesRequest, count_only: bool = False) -> ChatCompletionRequest:
    """The chat request this message is generated by (a 400 for what is not served);
    ``count_only``: for count_tokens, where max_tokens is not asked."""
    if not count_only and (req.max_tokens is None or req.max_tokens < 1):
        raise ApiError(400, f"max_tokens: a number of tokens of at least 1 is required, got {req.max_tokens}",
                       param="max_tokens")
    if req.mcp_servers:
        raise ApiError(400, "mcp_servers are not served: call the tools yourself and send tool_result blocks",
                       param="mcp_servers")
    if not req.messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    system = [ChatMessage(role="system", content=_text(req.system, "system"))] if req.system else []
    choice, parallel = _tool_choice(req.tool_choice)
    thinking = req.thinking.type if req.thinking is not None else None
    if thinking not in THINKING:
        raise ApiError(400, f"thinking.type must be one of {', '.join(repr(kind) for kind in THINKING if kind)}, got {thinking!r}",
                       param="thinking")
    turns = [turn for i, message in enumerate(req.messages) for turn in _turns(i, message)]
    # a last assistant turn of text is the answer's start, which the answer goes on from (Anthropic's prefill)
    prefill = turns[-1].role == "assistant" and bool(turns[-1].content) and not turns[-1].tool_calls
    return ChatCompletionRequest(
        messages=[*system, *turns], add_generation_prompt=not prefill, continue_final_message=prefill,
        model=req.model, max_completion_tokens=req.max_tokens if not count_only else None,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences, stream=req.stream,
        seed=req.seed, tools=_tools(req.tools), tool_choice=choice, parallel_tool_calls=parallel,
        chat_template_kwargs=None if THINKING[thinking] is None else {"enable_thinking": THINKING[thinking]},
        response_format=_format(req.output_config), priority=req.priority,
        thinking_token_budget=req.thinking.budget_tokens if thinking == "enabled" else None)


def within_context(req: ChatCompletionRequest, prompt_tokens: int, context: int) -> ChatCompletionRequest:
    """A message's max_tokens cut to the room its prompt leaves in the context (llama.cpp's way):
    Anthropic's clients are written for 200k-token windows (Claude Code asks for 32,000 tokens
    on every request), which vLLM's 400 for a max_tokens past the room would end at once. A
    prompt that leaves no room is still the 400."""
    room = context - prompt_tokens
    if req.max_completion_tokens is None or not 0 < room < req.max_completion_tokens:
        return req
    return msgspec.structs.replace(req, max_completion_tokens=room)


def shows_thinking(req: MessagesRequest) -> bool:
    """Whether thinking blocks carry their text (``display: "omitted"`` leaves it out)."""
    return req.thinking is None or req.thinking.display != "omitted"


def _format(config: OutputConfig | None) -> ResponseFormat | None:
    """output_config.format json_schema as chat's response_format (structured output)."""
    if config is None or config.format is None:
        return None
    if config.format.type != "json_schema" or not isinstance(config.format.schema, dict):
        raise ApiError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       param="output_config")
    return ResponseFormat(type="json_schema", json_schema={"name": "output", "schema": config.format.schema})


def chat_call_id(tool_use_id: str) -> str:
    """A tool_use block's id as the chat template gets it back: without the ``toolu_`` that
    anthropic_reply.tool_use_id put before the model's own (a Mistral template takes back its 9
    letters and digits only)."""
    return tool_use_id.removeprefix("toolu_")


def _turns(i: int, message: Message) -> list[ChatMessage]:
    """One Anthropic message as chat messages: a user turn's tool_result blocks become tool
    messages (before its text), an assistant turn's tool_use blocks its tool calls; a system
    message between them (Claude Code sends one, under the beta mid-conversation-system) stays one."""
    if message.role == "system":
        return [ChatMessage(role="system", content=_text(message.content, f"messages[{i}].content"))]
    if message.role not in ("user", "assistant"):
        raise ApiError(400, f"messages[{i}].role must be 'user', 'assistant' or 'system', got {message.role!r}",
                       param="messages")
    blocks = [Block(type="text", text=message.content)] if isinstance(message.content, str) else message.content
    texts, calls, results = [], [], []
    for j, block in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "tool_use" and message.role == "assistant":
            if not block.id or not block.name:
                raise ApiError(400, f"{where}: a tool_use block needs id and name", param="messages")
            arguments = json.dumps(block.input if block.input is not None else {}, ensure_ascii=False)
            calls.append(ToolCall(function=CalledFunction(name=block.name, arguments=arguments),
                                  id=chat_call_id(block.id)))
        elif block.type == "tool_result" and message.role == "user":
            if not block.tool_use_id:
                raise ApiError(400, f"{where}: a tool_result block needs tool_use_id", param="messages")
            results.append(ChatMessage(role="tool", content=_text(block.content, where) if block.content else "",
                                       tool_call_id=chat_call_id(block.tool_use_id)))
        elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
            continue  # an earlier answer's thinking: chat templates leave it out
        else:
            raise ApiError(400, f"{where}: a {block.type!r} block is not served in a {message.role} message: give "
                                "text, tool_use (assistant) or tool_result (user) blocks", param="messages")
    if message.role == "assistant":
        return [ChatMessage(role="assistant", content="".join(texts) if texts or not calls else None,
                            tool_calls=calls or None)]
    return [*results, *([ChatMessage(role="user", content="".join(texts))] if texts or not results else [])]


def _text(content: str | list[Block], where: str) -> str:
    """A system prompt's or a tool result's text: a string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if any(block.type != "text" for block in content):
        raise ApiError(400, f"{where}: only text blocks are served here", param="messages")
    return "".join(block.text or "" for block in content)


def _tools(tools: list[Any] | None) -> list[dict] | None:
    """Anthropic's client tools ({name, description, input_schema}) as chat's function tools."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not (isinstance(tool, dict) and tool.get("type", "custom") == "custom" and isinstance(tool.get("name"), str)
                and isinstance(tool.get("input_schema"), dict)):
            raise ApiError(400, f"tools[{i}] must be a client tool {{\"name\": ..., \"input_schema\": {{...}}}}: "
                                "Anthropic's server tools are not served", param="tools")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool]:
    """Anthropic's tool_choice as chat's, and whether calls may come several at once."""
    if choice is None:
        return None, True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel
    raise ApiError(400, f"tool_choice.type must be 'auto', 'any', 'tool' (with name) or 'none', got {kind!r}",
                   param="tool_choice")
