"""``specctl gateway``: the OpenAI-compatible HTTP door (aiohttp). Tokenises with the
target's tokenizer and chat template, routes each request to the least-loaded target
instance, streams text as tokens are accepted, and cancels the generation everywhere
when the HTTP client goes away (handler cancellation closes the upstream connection)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from specctl import __version__
from specctl.errors import ConfigError
from specctl.gateway import cors, request_id
from specctl.gateway import responses as R
from specctl.gateway.errors import error_middleware
from specctl.gateway.api import ApiError
from specctl.gateway.request_body import check_key
from specctl.gateway.generation import Generations
from specctl.gateway.infill import parse_infill
from specctl.gateway.llama import parse_completion
from specctl.gateway.sglang import parse_generate
from specctl.gateway.cache_routes import cache_routes
from specctl.gateway.text_routes import TextRoutes
from specctl.gateway.metrics import GatewayMetrics
from specctl.gateway.chat_template import load_chat_template
from specctl.gateway.reasoning import check_parser
from specctl.gateway.sampling_defaults import check_source
from specctl.gateway.tool_parsers import TOOL_PARSERS
from specctl.gateway.upstream import Upstream
from specctl.engine.text import encode_prompt
from specctl.net.keepalive import keep_alive
from specctl.net.protocol import Done
from specctl.spec.params import SamplingParams
from specctl.verify.client import RemoteError

HEALTH_GENERATE_TIMEOUT_S = 30.0  # /health_generate's token: a target stalled longer than this is unhealthy


MAX_BODY_BYTES = 16 << 20  # the largest request body the gateway reads (413 past it; --max-body-kb)


@dataclass(slots=True)
class GatewayConfig:
    model_name: str
    context: int
    host: str = "127.0.0.1"
    port: int = 8000
    default_max_tokens: int = 256
    max_body_bytes: int = MAX_BODY_BYTES  # lm-eval's 128 long prompts fit; bounds what a body costs to tokenize
    api_key: str | None = None
    responses_store: int = 256  # Responses API answers kept for previous_response_id and GET (gateway.response_store)
    # vLLM's --served-model-name: the names requests may give; answers carry the first (default: model_name)
    served_model_names: tuple[str, ...] = ()
    scheduling_policy: str = "fcfs"  # vLLM's: "priority" orders waiting generations by their request's priority
    allowed_origins: tuple[str, ...] = ()  # browser origins answered with CORS headers (gateway.cors; "*": any)
    request_id_headers: bool = False  # vLLM's --enable-request-id-headers: X-Request-Id on every answer
    log_requests: bool = False  # vLLM's --enable-log-requests: a line per generation request taken and ended
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser: chat answers' thinking apart (gateway.reasoning)
    tool_call_parser: str = "hermes"  # vLLM's --tool-call-parser: how calls are read back (gateway.tool_calls)
    # (name, value) pairs a request's missing sampling fields take (gateway.sampling_defaults); (): OpenAI's
    sampling_defaults: tuple[tuple[str, float], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """The model names this gateway answers to; answers carry the first."""
        return self.served_model_names or (self.model_name,)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.context < 2 or self.default_max_tokens < 1 or self.max_body_bytes < 1024:
            raise ValueError("context must be >= 2, default_max_tokens >= 1 and max_body_bytes >= 1024")
        check_serving(self.responses_store, self.served_model_names, self.scheduling_policy,
                      reasoning_parser=self.reasoning_parser, tool_call_parser=self.tool_call_parser)


def served_context(model_context: int, max_model_len: int | None) -> int:
    """The context the gateway serves: the model's, or vLLM's --max-model-len below it (ValueError above)."""
    if max_model_len is None:
        return model_context
    if not 2 <= max_model_len <= model_context:
        raise ValueError(f"--max-model-len must be between 2 and the model's context of {model_context} tokens, got "
                         f"{max_model_len}")
    return max_model_len


def check_serving(responses_store: int = 0, served_model_names: tuple[str, ...] = (), scheduling_policy: str = "fcfs",
                  max_waiting: int = 0, queue_timeout_s: float = 0.0, reasoning_parser: str | None = None,
                  tool_call_parser: str = "hermes", generation_config: str = "auto",
                  chat_template: str | None = None) -> None:
    """The serving options `gateway` and `up` take (the gateway's, its waiting line's), checked
    once for the CLI, the embedded cluster and GatewayConfig: a ValueError naming the flag."""
    if any(not name.strip() for name in served_model_names):
        raise ValueError("a served model name must not be empty (--served-model-name)")
    if scheduling_policy not in ("fcfs", "priority"):
        raise ValueError(f"--scheduling-policy must be fcfs or priority, got {scheduling_policy!r}")
    if min(responses_store, max_waiting, queue_timeout_s) < 0:
        raise ValueError(f"--responses-store, --max-waiting and --queue-timeout must be >= 0, got {responses_store}, "
                         f"{max_waiting}, {queue_timeout_s:g}")
    check_parser(reasoning_parser)
    if tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got {tool_call_parser!r}")
    if tool_call_parser == "openai" and reasoning_parser != "openai_gptoss":
        raise ValueError("--tool-call-parser openai reads the calls gpt-oss's harmony messages hold, which "
                         "--reasoning-parser openai_gptoss takes apart: give both")
    check_source(generation_config)
    if chat_template is not None:
        load_chat_template(chat_template)


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: Any, upstream: Upstream, metrics: GatewayMetrics) -> None:
        self.config, self.tokenizer, self.upstream, self.metrics = config, tokenizer, upstream, metrics
        self.generations = Generations(config, tokenizer, upstream, metrics)
        self.created = int(time.time())
        self._runner: web.AppRunner | None = None

    @property
    def running(self) -> int:
        """Generation requests in flight."""
        return self.generations.running

    # --- lifecycle -----------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._preflight, error_middleware(self.config.max_body_bytes)])
        app.on_response_prepare.append(self._allow_origin)
        app.on_response_prepare.append(self._add_request_id)
        app.add_routes([
            web.post("/v1/completions", self._completions), web.post("/v1/chat/completions", self._chat),
            web.post("/v1/responses", self._responses),
            web.post("/v1/messages", self._messages), web.post("/v1/messages/count_tokens", self._count_tokens),
            web.get("/v1/responses/{response_id}", self._stored_response),
            web.delete("/v1/responses/{response_id}", self._delete_response),
            web.get("/v1/responses/{response_id}/input_items", self._input_items),
            web.get("/v1/models", self._models), web.get("/v1/models/{model:.+}", self._model),
            web.get("/version", self._version), web.get("/health", self._health),
            web.get("/ping", self._health), web.post("/ping", self._health), web.get("/load", self._load),
            web.get("/health_generate", self._health_generate),
            web.get("/metrics", self._metrics), web.get("/v1/stats", self._stats),
            web.post("/infill", self._infill),
            web.post("/completion", self._llama_completion), web.post("/completions", self._llama_completion),
            web.post("/generate", self._sglang_generate), *TextRoutes(self).routes(),
            *cache_routes(self.upstream, self.config.api_key),
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
        self.generations.close()

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
    async def _preflight(self, request: web.Request, handler) -> web.StreamResponse:
        keep_alive(request.transport)  # a client gone without a FIN: its request is cancelled in about a minute
        return cors.preflight(request, self.config.allowed_origins) or await handler(request)

    async def _allow_origin(self, request: web.Request, response: web.StreamResponse) -> None:
        cors.add_allow_origin(request, response, self.config.allowed_origins)

    async def _add_request_id(self, request: web.Request, response: web.StreamResponse) -> None:
        if self.config.request_id_headers:
            request_id.add_header(request, response)

    def _check_key(self, request: web.Request) -> None:
        check_key(request, self.config.api_key)

    def _check_model(self, model: str | None) -> None:
        self.generations.check_model(model)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generations.serve(request, "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self.generations.serve(request, "chat")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self.generations.serve(request, "responses")

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API (gateway.anthropic_api)."""
        return await self.generations.serve(request, "messages")

    async def _count_tokens(self, request: web.Request) -> web.Response:
        return await self.generations.count_tokens(request)

    async def _infill(self, request: web.Request) -> web.StreamResponse:
        """llama.cpp's /infill (gateway.infill): code completion for editor plugins."""
        return await self.generations.serve(request, "infill", parse_infill)

    async def _llama_completion(self, request: web.Request) -> web.StreamResponse:
        """llama.cpp's /completion (gateway.llama)."""
        return await self.generations.serve(request, "completion", parse_completion)

    # --- endpoints -----------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        self._check_key(request)
        return web.json_response(R.models_list(self.config.names, self.created, self.config.context,
                                               self.config.model_name))

    async def _model(self, request: web.Request) -> web.Response:
        """OpenAI's GET /v1/models/{model} (the client's models.retrieve)."""
        self._check_key(request)
        model = request.match_info["model"]
        if model not in self.config.names:  # _check_model passes an empty name
            self._check_model(model or " ")
        return web.json_response(R.model_card(model, self.created, self.config.context, self.config.model_name))

    async def _stored_response(self, request: web.Request) -> web.Response:
        """OpenAI's GET /v1/responses/{id} (the client's responses.retrieve): a stored response."""
        self._check_key(request)
        return web.json_response(self.generations.responses.read(request.match_info["response_id"]))

    async def _delete_response(self, request: web.Request) -> web.Response:
        self._check_key(request)
        return web.json_response(self.generations.responses.remove(request.match_info["response_id"]))

    async def _input_items(self, request: web.Request) -> web.Response:
        """OpenAI's GET /v1/responses/{id}/input_items (the client's responses.input_items.list)."""
        self._check_key(request)
        return web.json_response(self.generations.responses.input_items(request.match_info["response_id"],
                                                                        request.query))

    async def _sglang_generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's /generate (gateway.sglang)."""
        return await self.generations.serve(request, "generate", parse_generate)

    async def _version(self, _request: web.Request) -> web.Response:
        """vLLM's GET /version: this gateway's specctl version."""
        return web.json_response({"version": __version__})

    async def _health(self, _request: web.Request) -> web.Response:
        up = sum(t.up for t in self.upstream.targets)
        return web.json_response({"status": "ok" if up else "unavailable", "targets_up": up,
                                  "targets": len(self.upstream.targets)}, status=200 if up else 503)

    async def _load(self, _request: web.Request) -> web.Response:
        """vLLM's GET /load: the generation requests in flight."""
        return web.json_response({"server_load": self.generations.running})

    async def _health_generate(self, _request: web.Request) -> web.Response:
        """SGLang's GET /health_generate: healthy only if a target instance generates a token
        now (/health asks whether one answers at all)."""
        prompt, params = encode_prompt(self.tokenizer, "health") or [0], SamplingParams(max_tokens=1, ignore_eos=True)
        try:
            async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
                async with self.upstream.stream(prompt, params, 0, "health_generate") as (stream, first):
                    while not isinstance(first, Done):
                        first = await stream.next()
        except (ApiError, RemoteError, TimeoutError) as exc:
            return web.json_response({"status": "unavailable", "error": str(exc) or "no token in time"}, status=503)
        return web.json_response({"status": "ok"})

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _stats(self, request: web.Request) -> web.Response:
        """The stats feed for the monitor: the latest snapshot of every role."""
        self._check_key(request)
        feed = {"time": time.time(), "model": self.config.model_name,
                "gateway": {"requests_running": self.generations.running,
                            "requests_waiting": len(self.upstream.waiting),
                            "resumed_generations": self.metrics.resumed_count(), **self.metrics.latency_summary()}}
        feed.update(self.upstream.snapshot())
        return web.json_response(feed)

