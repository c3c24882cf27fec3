"""``specctl gateway``: the OpenAI-compatible HTTP door (aiohttp). Tokenises with the
target's tokenizer and chat template, routes each request to the least-loaded target
instance, streams text as tokens are accepted, and cancels the generation everywhere
when the HTTP client goes away (handler cancellation closes the upstream connection)."""

from __future__ import annotations

import asyncio
import errno
import os
import contextlib
import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, AsyncIterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from specctl import __version__
from specctl.engine.text import encode_chat, encode_prompt, token_bytes_of
from specctl.errors import BadRequest, ConfigError
from specctl.gateway import responses as R
from specctl.gateway.api import (
    MAX_CHOICES, ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse_body,
    refuse_unsupported, wanted_logprobs,
)
from specctl.gateway.choices import Choices, choice_specs
from specctl.gateway.respond import Reply, remote_message
from specctl.gateway.structured import structured_output
from specctl.gateway.tool_calls import ForcedCalls, StreamedCalls
from specctl.gateway.tools import forced_call, request_tools
from specctl.gateway.translate import (
    chat_messages, chat_template_options, completion_prompts, sampling_params, stop_strings, truncated,
)
from specctl.gateway.metrics import GatewayMetrics
from specctl.gateway.upstream import Upstream
from specctl.verify.client import RemoteError

log = logging.getLogger("specctl.gateway")

REMOTE_STATUS = {"bad_request": 400, "capacity": 503, "unavailable": 503}


@dataclass(slots=True)
class GatewayConfig:
    model_name: str
    context: int
    host: str = "127.0.0.1"
    port: int = 8000
    default_max_tokens: int = 256
    max_body_bytes: int = 1 << 20
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.context < 2 or self.default_max_tokens < 1 or self.max_body_bytes < 1024:
            raise ValueError("context must be >= 2, default_max_tokens >= 1 and max_body_bytes >= 1024")


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: Any, upstream: Upstream, metrics: GatewayMetrics) -> None:
        self.config, self.tokenizer, self.upstream, self.metrics = config, tokenizer, upstream, metrics
        self._token_bytes = token_bytes_of(tokenizer)
        self.created = int(time.time())
        self.running = 0
        self._runner: web.AppRunner | None = None

    # --- lifecycle -----------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._errors])
        app.add_routes([
            web.post("/v1/completions", self._completions), web.post("/v1/chat/completions", self._chat),
            web.get("/v1/models", self._models), web.get("/v1/models/{model:.+}", self._model),
            web.get("/version", self._version), web.get("/health", self._health),
            web.get("/metrics", self._metrics), web.get("/v1/stats", self._stats),
            web.post("/tokenize", self._tokenize), web.post("/detokenize", self._detokenize),
        ])
        app.cleanup_ctx.append(self._poller)
        return app

    async def _poller(self, _app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self.upstream.poll_forever())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self.upstream.close()

    async def start(self) -> int:
        await self.upstream.poll_once()  # know the instances' capacities before the first request
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self.config.host, self.config.port).start()
        except OSError as exc:
            await self._runner.cleanup()
            reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
            raise ConfigError(f"cannot listen on {self.config.host}:{self.config.port}: {reason}"
                              + ("; stop what listens there or pick another port with --port"
                                 if exc.errno == errno.EADDRINUSE else "")) from None
        return self._runner.addresses[0][1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # --- plumbing ------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every error leaves as an OpenAI-style JSON body; the gateway carries on."""
        try:
            return await handler(request)
        except ApiError as exc:
            headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
            return web.json_response(exc.body(), status=exc.status, headers=headers)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = {413: f"request body too large (limit {self.config.max_body_bytes} bytes)",
                       404: f"no route {request.method} {request.path}"}.get(exc.status, exc.reason)
            return web.json_response(ApiError(exc.status, message).body(), status=exc.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:  # noqa: BLE001
            log.exception("request %s failed", request.path)
            return web.json_response(ApiError(500, f"internal error: {exc}", type="server_error").body(), status=500)

    def _check_key(self, request: web.Request) -> None:
        if self.config.api_key and request.headers.get("Authorization", "") != f"Bearer {self.config.api_key}":
            raise ApiError(401, "Incorrect API key provided: send `Authorization: Bearer <key>`", code="invalid_api_key")

    # --- endpoints -----------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        self._check_key(request)
        return web.json_response(R.models_list(self.config.model_name, self.created, self.config.context))

    async def _model(self, request: web.Request) -> web.Response:
        """OpenAI's GET /v1/models/{model} (the client's models.retrieve)."""
        self._check_key(request)
        model = request.match_info["model"]
        if model != self.config.model_name:  # _check_model passes an empty name
            self._check_model(model or " ")
        return web.json_response(R.model_card(self.config.model_name, self.created, self.config.context))

    async def _version(self, _request: web.Request) -> web.Response:
        """vLLM's GET /version: this gateway's specctl version."""
        return web.json_response({"version": __version__})

    async def _health(self, _request: web.Request) -> web.Response:
        up = sum(t.up for t in self.upstream.targets)
        return web.json_response({"status": "ok" if up else "unavailable", "targets_up": up,
                                  "targets": len(self.upstream.targets)}, status=200 if up else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _stats(self, request: web.Request) -> web.Response:
        """The stats feed for the monitor: the latest snapshot of every role."""
        self._check_key(request)
        feed = {"time": time.time(), "model": self.config.model_name,
                "gateway": {"requests_running": self.running}}
        feed.update(self.upstream.snapshot())
        return web.json_response(feed)

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: the ids a prompt (or chat messages) becomes, as generation encodes it."""
        self._check_key(request)
        req = parse_body(await request.read(), TokenizeRequest)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give either prompt or messages", param="prompt")
        chat = req.messages is not None
        parsed = (ChatCompletionRequest(messages=req.messages, tools=req.tools,
                                        add_generation_prompt=req.add_generation_prompt,
                                        continue_final_message=req.continue_final_message,
                                        chat_template_kwargs=req.chat_template_kwargs) if chat
                  else CompletionRequest(prompt=req.prompt))
        [ids] = self._encode(parsed, self._tools(parsed))
        return web.json_response({"count": len(ids), "max_model_len": self.config.context, "tokens": ids})

    async def _detokenize(self, request: web.Request) -> web.Response:
        self._check_key(request)
        req = parse_body(await request.read(), DetokenizeRequest)
        self._check_model(req.model)
        vocab = len(self.tokenizer)
        if req.tokens and (min(req.tokens) < 0 or max(req.tokens) >= vocab):
            raise ApiError(400, f"token ids must be in [0, {vocab}), got {min(req.tokens)}..{max(req.tokens)}",
                           param="tokens")
        return web.json_response({"prompt": self.tokenizer.decode(req.tokens)})

    def _check_model(self, model: str | None) -> None:
        if model and model != self.config.model_name:
            raise ApiError(404, f"The model `{model}` does not exist. This gateway serves `{self.config.model_name}`.",
                           param="model", code="model_not_found")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def _encode(self, req: CompletionRequest | ChatCompletionRequest, tools: list[dict] | None) -> list[list[int]]:
        """The request's prompts as token ids: chat messages (with the tools the model is told
        of), or a completion prompt (text, token ids, or a batch of either)."""
        try:
            if isinstance(req, ChatCompletionRequest):
                return [encode_chat(self.tokenizer, chat_messages(req), tools, chat_template_options(req))]
            prompts = completion_prompts(req.prompt)
            ids = [encode_prompt(self.tokenizer, p) if isinstance(p, str) else p for p in prompts]
        except BadRequest as exc:
            raise ApiError(400, str(exc)) from None
        if not all(ids):
            raise ApiError(400, "the prompt is empty", param="prompt")
        return ids

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        endpoint = "chat" if chat else "completions"
        status = "error"
        self.running += 1
        self.metrics.running.set(self.running)
        try:
            self._check_key(request)
            req = parse_body(await request.read(), ChatCompletionRequest if chat else CompletionRequest)
            refuse_unsupported(req)
            self._check_model(req.model)
            stop = stop_strings(req)
            tools = self._tools(req)
            prompts = truncated(self._encode(req, tools), req.truncate_prompt_tokens, self.config.context)
            one_call = chat and not req.parallel_tool_calls
            forced = forced_call(tools, req.tool_choice, parallel=not one_call)
            structured = structured_output(req, forced[1] if forced else None)
            specs = choice_specs(prompts, [sampling_params(req, len(p), self.config.context,
                                                           self.config.default_max_tokens, structured)
                                           for p in prompts], req.n, self._echoes(req, prompts))
            self._check_room(len(specs))
            prompt_tokens = sum(map(len, prompts))
            self.metrics.prompt_tokens.inc(prompt_tokens)
            with_logprobs = wanted_logprobs(req) is not None
            reply = Reply(self.config.model_name, chat, prompt_tokens,
                          (lambda entries, offset: self._logprobs(chat, entries, offset)) if with_logprobs else None,
                          calls=None if tools is None else (partial(ForcedCalls, forced[0]) if forced
                                                                            else partial(StreamedCalls, 1 if one_call else None)),
                          include_usage=bool(req.stream_options and req.stream_options.include_usage), n=req.n)
            try:
                async with Choices(self.upstream, self.metrics, self.tokenizer, specs, stop,
                                   req.include_stop_str_in_output) as choices:
                    response = await (reply.stream(request, choices) if req.stream else reply.collect(choices))
            except RemoteError as exc:
                raise ApiError(REMOTE_STATUS.get(exc.code, 502), remote_message(exc),
                               type="invalid_request_error" if exc.code == "bad_request" else "server_error") from None
            status = "ok"
            return response
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        except ApiError as exc:
            status = str(exc.status)
            raise
        finally:
            self.running -= 1
            self.metrics.running.set(self.running)
            self.metrics.requests.labels(endpoint=endpoint, status=status).inc()

    def _echoes(self, req, prompts: list[list[int]]) -> list[str] | None:
        """Each prompt's text as echo hands it back: as given, or decoded from its token ids."""
        if not getattr(req, "echo", False):
            return None
        return [p if isinstance(p, str) and req.truncate_prompt_tokens is None else self.tokenizer.decode(ids)
                for p, ids in zip(completion_prompts(req.prompt), prompts)]

    def _check_room(self, generations: int) -> None:
        """A request's choices run at once: more than the instances that are up can ever hold
        at once is refused (fewer, but busy now, is the usual 503 to retry)."""
        if generations > MAX_CHOICES:
            raise ApiError(400, f"this request asks for {generations} generations (n times the prompts); at most "
                                f"{MAX_CHOICES}", param="n")
        room = sum(view.capacity for view in self.upstream.views() if view.up)
        if room and generations > room:
            raise ApiError(400, f"this request asks for {generations} generations at once (n times the prompts) but "
                                f"the target instances hold {room} sessions in all: lower n or send fewer prompts",
                           param="n")

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _logprobs(self, chat: bool, entries: list, offset: int = 0) -> dict | None:
        return R.logprobs_body(chat, entries, self._token_text, offset, self._token_bytes)

    def _tools(self, req) -> list[dict] | None:
        if not isinstance(req, ChatCompletionRequest):
            return None
        return request_tools(req.tools, req.tool_choice, getattr(self.tokenizer, "chat_template", None))
