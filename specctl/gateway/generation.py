"""The gateway's generation requests (/v1/completions, /v1/chat/completions): a request
parsed and checked (gateway.api, gateway.translate), its prompts encoded, its choices run on
the target instances (gateway.choices) and answered whole or streamed (gateway.respond)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Any, Callable

from aiohttp import web

from specctl.engine.fim import encode_infill, infill_stops
from specctl.engine.text import encode_prompt, render_chat, token_bytes_of
from specctl.errors import BadRequest
from specctl.gateway import responses as R
from specctl.gateway.anthropic_api import MessagesRequest, as_chat as messages_as_chat, shows_thinking, within_context
from specctl.gateway.anthropic_reply import AnthropicReply
from specctl.gateway.keepalive import started
from specctl.gateway.api import MAX_CHOICES, ApiError, ChatCompletionRequest, CompletionRequest
from specctl.gateway.request_body import check_key, parse_body
from specctl.gateway.request_checks import check_prompt_chars, refuse_unsupported, wanted_logprobs
from specctl.gateway.choices import Choices, choice_specs
from specctl.gateway.llama_reply import LlamaReply
from specctl.gateway.sglang import SglangReply
from specctl.gateway.metrics import GatewayMetrics
from specctl.gateway.reasoning import KEEPS_SPECIAL_TOKENS as READS_SPECIAL_TOKENS, thinking_budget, thinks
from specctl.gateway import request_log
from specctl.gateway.request_id import request_id
from specctl.gateway.respond import Reply, remote_message
from specctl.gateway.response_store import ResponseStore, StoredResponse
from specctl.gateway.responses_api import ResponsesRequest, answer_turn, as_chat, input_messages, input_records
from specctl.gateway.responses_reply import ResponsesReply
from specctl.gateway.structured import after_thinking, structured_output
from specctl.gateway.tool_parsers import KEEPS_SPECIAL_TOKENS, READS_TOOL_NAMES, TOOL_PARSERS
from specctl.gateway.tool_calls import ForcedCalls, StreamedCalls
from specctl.gateway.tools import forced_call, request_tools
from specctl.gateway.translate import (
    bad_words, chat_messages, chat_template_options, completion_prompts, message_text, prediction_tokens, prompt_only,
    sampling_params, stop_patterns, stop_strings, template_variables, truncated,
)
from specctl.gateway.upstream import Upstream
from specctl.verify.client import RemoteError

if TYPE_CHECKING:
    from specctl.gateway.config import GatewayConfig

REMOTE_STATUS = {"bad_request": 400, "capacity": 503, "unavailable": 503}
NATIVE_ENDPOINTS = ("completion", "infill", "generate")  # llama.cpp's own (gateway.llama), SGLang's (gateway.sglang)
# (body, tokenizer, context, model name) -> the completion request a native API's body amounts to, and its reply
NativeParser = Callable[[bytes, Any, int, str], tuple[CompletionRequest, "LlamaReply | SglangReply"]]


class Generations:
    """The generation requests of one gateway; ``running`` counts those in flight."""

    def __init__(self, config: "GatewayConfig", tokenizer: Any, upstream: Upstream, metrics: GatewayMetrics) -> None:
        self.config, self.tokenizer, self.upstream, self.metrics = config, tokenizer, upstream, metrics
        self._token_bytes = token_bytes_of(tokenizer)
        # a token's text, as logprobs name it: the same ids come back again and again (a long
        # prompt's prompt_logprobs with 20 alternatives each: 0.26 s of decodes on the event
        # loop for 4,000 tokens, 0.08 s read back from here)
        self._token_text: Callable[[int], str] = lru_cache(maxsize=1 << 16)(lambda token: tokenizer.decode([token]))
        self.running = 0
        self.responses = ResponseStore(config.responses_store)
        self.defaults = dict(config.sampling_defaults)  # what a request leaves out (gateway.sampling_defaults)
        # Encoding a request (its chat template, its prompts) off the event loop, where every
        # stream is read: a megabyte prompt takes most of a second to tokenize, and the
        # tokenizer's Rust half lets the loop run meanwhile (vLLM's API server does the same).
        # One thread: the requests' encodings never overlap (the loop only decodes).
        self._encoding: ThreadPoolExecutor | None = None  # started with the first request, ended by close()
        if config.log_requests:
            request_log.enable()

    async def off_loop(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` on the encoding thread (a request's tokenization), its error raised here."""
        if self._encoding is None:
            self._encoding = ThreadPoolExecutor(1, thread_name_prefix="gateway-encode")
        return await asyncio.get_running_loop().run_in_executor(self._encoding, partial(fn, *args))

    def close(self) -> None:
        if self._encoding is not None:
            self._encoding.shutdown(wait=False, cancel_futures=True)
            self._encoding = None

    def check_model(self, model: str | None) -> None:
        if model and model not in self.config.names:
            raise ApiError(404, f"The model `{model}` does not exist. This gateway serves "
                                f"{', '.join(f'`{name}`' for name in self.config.names)}.",
                           param="model", code="model_not_found")

    def encode(self, req: CompletionRequest | ChatCompletionRequest, tools: list[dict] | None) -> list[list[int]]:
        """The request's prompts as token ids: chat messages (with the tools the model is told
        of), or a completion prompt (text, token ids, or a batch of either)."""
        try:
            if isinstance(req, ChatCompletionRequest):  # engine.text.encode_chat, its text checked first
                text = render_chat(self.tokenizer, chat_messages(req), tools, chat_template_options(req))
                check_prompt_chars(len(text), self.tokenizer, self.config.context, "messages")
                return [self.tokenizer.encode(text, add_special_tokens=False)]
            prompts = completion_prompts(req.prompt)
            for p in prompts:  # a prompt's text (and an infill's suffix): token ids are not tokenized
                chars = (len(p) if isinstance(p, str) else 0) + len(req.suffix or "")
                check_prompt_chars(chars, self.tokenizer, self.config.context)
            if req.suffix is not None:  # fill in the middle: the text between each prompt and the suffix
                try:
                    ids = [encode_infill(self.tokenizer, p, req.suffix) for p in prompts]
                except BadRequest as exc:
                    raise ApiError(400, str(exc), param="suffix") from None
            else:
                ids = [encode_prompt(self.tokenizer, p) if isinstance(p, str) else p for p in prompts]
        except BadRequest as exc:
            raise ApiError(400, str(exc)) from None
        if not all(ids):
            raise ApiError(400, "the prompt is empty", param="prompt")
        return ids

    async def serve(self, request: web.Request, endpoint: str, native: NativeParser | None = None) -> web.StreamResponse:
        """One generation request of ``endpoint`` ("completions", "chat", "responses": a chat
        request answered as a response, gateway.responses_api; "completion", "infill",
        "generate": llama.cpp's and SGLang's, whose body ``native`` reads as the completion
        request it amounts to and the reply that answers it, gateway.llama and gateway.sglang),
        answered whole or streamed; counted in the metrics however it ends."""
        chat = endpoint not in ("completions", *NATIVE_ENDPOINTS)
        arrival = time.perf_counter()
        status, rid, choices = "error", None, None
        self.running += 1
        self.metrics.running.set(self.running)
        try:
            check_key(request, self.config.api_key)
            if native is not None:
                req, native_reply = await self.off_loop(native, await request.read(), self.tokenizer,
                                                        self.config.context, self.config.names[0])
            elif endpoint == "responses":
                asked = parse_body(await request.read(), ResponsesRequest)
                history = self.responses.history(asked.previous_response_id)
                req = as_chat(asked, history)
            elif endpoint == "messages":  # Anthropic's (gateway.anthropic_api)
                asked = parse_body(await request.read(), MessagesRequest)
                req = messages_as_chat(asked)
            else:
                req = parse_body(await request.read(), ChatCompletionRequest if chat else CompletionRequest)
            rid = request_id(request, req.request_id)
            refuse_unsupported(req)
            self.check_model(req.model)
            if req.priority and self.config.scheduling_policy != "priority":
                raise ApiError(400, "priority scheduling is not enabled: start the gateway with --scheduling-policy "
                                    "priority, or leave priority out", param="priority")
            stop, patterns = stop_strings(req), stop_patterns(req)
            one_call = chat and not req.parallel_tool_calls
            tools, prompts, forced, specs = await self.off_loop(self._prepare, req, chat, endpoint, one_call)
            self._check_count(len(specs))
            if self.config.log_requests:
                request_log.received(rid, endpoint, list(map(len, prompts)), specs[0].params, req.n, req.stream)
            prompt_tokens = sum(map(len, prompts))
            self.metrics.prompt_tokens.inc(prompt_tokens)
            parser = self.config.tool_call_parser
            named = ({"tool_names": frozenset(tool["function"]["name"] for tool in tools)}
                     if tools is not None and parser in READS_TOOL_NAMES else {})
            calls = None if tools is None else (
                partial(ForcedCalls, forced.named) if forced and not forced.native
                else partial(StreamedCalls, 1, "stop") if forced  # a named call in hermes' own format
                else partial(TOOL_PARSERS[parser], 1 if one_call else None, **named))
            reply = (self._responses_reply(asked, req, history, prompt_tokens, calls) if endpoint == "responses"
                     else AnthropicReply(self.config.names[0], prompt_tokens, calls, self.thinking(req),
                                         shows_thinking(asked))
                     if endpoint == "messages"
                     else native_reply if native is not None else self._reply(req, chat, prompt_tokens, calls, rid))
            try:
                # a parser whose tags are special tokens reads them in the text (vLLM's mistral does the same)
                keep_special = ((tools is not None and not forced
                                 and self.config.tool_call_parser in KEEPS_SPECIAL_TOKENS)
                                or (chat and self.config.reasoning_parser in READS_SPECIAL_TOKENS))
                choices = Choices(self.upstream, self.metrics, self.tokenizer, specs, stop,
                                  req.include_stop_str_in_output, arrival, req.priority, rid,
                                  req.skip_special_tokens and not keep_special, patterns)
                async with started(choices, request if req.stream else None, reply):
                    response = await (reply.stream(request, choices) if req.stream else reply.collect(choices))
            except RemoteError as exc:
                raise ApiError(REMOTE_STATUS.get(exc.code, 502), remote_message(exc),
                               type="invalid_request_error" if exc.code == "bad_request" else "server_error") from None
            status = "ok"
            return response
        except asyncio.CancelledError:  # the client left; after the whole answer (a client that closes on
            status = "ok" if choices is not None and choices.finished else "cancelled"  # [DONE]) it is served
            raise
        except ApiError as exc:
            status = str(exc.status)
            raise
        finally:
            self.running -= 1
            self.metrics.running.set(self.running)
            self.metrics.requests.labels(endpoint=endpoint, status=status).inc()
            if self.config.log_requests and rid is not None:
                request_log.finished(rid, endpoint, status, choices.completion_tokens if choices else 0,
                                     time.perf_counter() - arrival)

    def _prepare(self, req, chat: bool, endpoint: str, one_call: bool) -> tuple:
        """A request's encoding (on the encoding thread): (its tools, its prompts' token ids, its
        forced call, its choices); ``one_call``: parallel_tool_calls false."""
        tools = self.tools(req)
        prompts = truncated(self.encode(req, tools), req.truncate_prompt_tokens, self.config.context)
        if endpoint == "messages":
            req = within_context(req, len(prompts[0]), self.config.context)
        forced = forced_call(tools, req.tool_choice, not one_call, self.config.tool_call_parser, self.tokenizer)
        structured = after_thinking(structured_output(req, forced.structured if forced else None),
                                    self.thinking(req) if chat else None)
        barred = bad_words(req.bad_words, self.tokenizer)
        ends = infill_stops(self.tokenizer) if getattr(req, "suffix", None) is not None else ()
        predicted = prediction_tokens(req, self.tokenizer, self.config.context)
        budget = self.thinking_budget(req, endpoint)
        specs = choice_specs(prompts, [sampling_params(req, len(p), self.config.context, self.config.default_max_tokens,
                                                       structured, barred, self.defaults, ends, predicted, budget)
                                       for p in prompts], req.n, self._echoes(req, prompts),
                             echo_only=prompt_only(req))
        return tools, prompts, forced, specs

    def _responses_reply(self, asked: ResponsesRequest, req: ChatCompletionRequest, history: tuple,
                         prompt_tokens: int, calls) -> ResponsesReply:
        """A response's answer: stored as asked, its text's logprobs as chat's ``content`` items."""
        logprobs = ((lambda entries: self._logprobs(True, entries)["content"])
                    if wanted_logprobs(req) is not None else None)
        return ResponsesReply(self.config.names[0], prompt_tokens, asked, calls, self._keeper(asked, history),
                              logprobs, self.thinking(req),
                              lambda text: len(self.tokenizer.encode(text, add_special_tokens=False)))

    def _keeper(self, asked: ResponsesRequest, history: tuple) -> Any:
        """What stores a finished response with the conversation it ends (None: not stored)."""
        if asked.store is False or self.responses.capacity == 0:
            return None
        asked_turns, records = (*history, *input_messages(asked)), input_records(asked)
        return lambda body: self.responses.put(StoredResponse(body, (*asked_turns, answer_turn(body["output"])),
                                                              records))

    def _reply(self, req, chat: bool, prompt_tokens: int, calls, rid: str) -> Reply:
        """A completion's or chat's answer: logprobs as asked, tool calls read back by ``calls``."""
        logprobs = ((lambda entries, offset: self._logprobs(chat, entries, offset, req.return_tokens_as_token_ids))
                    if wanted_logprobs(req) is not None else None)
        usage = req.stream_options is not None and req.stream_options.include_usage
        prompt_logprobs = (None if req.prompt_logprobs is None else
                           partial(R.prompt_logprobs_body, alternatives=req.prompt_logprobs, token_text=self._token_text))
        return Reply(self.config.names[0], chat, prompt_tokens, logprobs, calls=calls, include_usage=usage,
                     continuous_usage=usage and req.stream_options.continuous_usage_stats, n=req.n,
                     prompt_logprobs=prompt_logprobs, request_id=rid,
                     text_length=lambda token: len(self._token_text(token)),
                     thinking=self.thinking(req) if chat else None,
                     include_reasoning=getattr(req, "include_reasoning", True), token_ids=req.return_token_ids,
                     predicted=req.prediction is not None)

    def thinking(self, req) -> bool | None:
        """With a reasoning parser, whether a chat request's output starts in thought (None: no parser)."""
        parser = self.config.reasoning_parser
        if parser is None:
            return None
        continued = message_text(req.messages[-1]) if req.continue_final_message and req.messages else None
        return thinks(parser, template_variables(req), continued)

    def thinking_budget(self, req: ChatCompletionRequest | CompletionRequest, endpoint: str) -> tuple | None:
        """The request's thinking budget (gateway.reasoning.thinking_budget), chat's or a raw
        completion's; Anthropic's is dropped where the parser cannot end a thought."""
        try:
            return thinking_budget(req.thinking_token_budget, self.config.reasoning_parser,
                                   self.tokenizer, required=endpoint != "messages")
        except ValueError as exc:
            raise ApiError(400, str(exc), param="thinking_token_budget") from None

    def _echoes(self, req, prompts: list[list[int]]) -> list[str] | None:
        """Each prompt's text as echo hands it back: as given, or decoded from its token ids."""
        if not getattr(req, "echo", False):
            return None
        return [p if isinstance(p, str) and req.truncate_prompt_tokens is None else self.tokenizer.decode(ids)
                for p, ids in zip(completion_prompts(req.prompt), prompts)]

    def _check_count(self, generations: int) -> None:
        """At most MAX_CHOICES generations a request. More than the instances hold at once run
        in turns, as vLLM queues a batch (lm-eval sends its batch_size prompts in one request):
        those past the sessions wait in the line (gateway.waiting) for the ones before them."""
        if generations > MAX_CHOICES:
            raise ApiError(400, f"this request asks for {generations} generations (n times the prompts); at most "
                                f"{MAX_CHOICES}", param="n")

    def _logprobs(self, chat: bool, entries: list, offset: int = 0, as_ids: bool = False) -> dict | None:
        return R.logprobs_body(chat, entries, self._token_text, offset, self._token_bytes, as_ids)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's POST /v1/messages/count_tokens: the prompt's tokens as /v1/messages renders it."""
        check_key(request, self.config.api_key)
        req = messages_as_chat(parse_body(await request.read(), MessagesRequest), count_only=True)
        self.check_model(req.model)
        [ids] = await self.off_loop(lambda: self.encode(req, self.tools(req)))
        return web.json_response({"input_tokens": len(ids)})

    def tools(self, req) -> list[dict] | None:
        if not isinstance(req, ChatCompletionRequest):
            return None
        return request_tools(req.tools, req.tool_choice, getattr(self.tokenizer, "chat_template", None))
