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
from specctl.gateway.config import GatewayConfig
from specctl.gateway.text_routes import TextRoutes
from specctl.gateway.metrics import GatewayMetrics
from specctl.gateway.upstream import Upstream
from specctl.engine.text import encode_prompt
from specctl.net.keepalive import keep_alive
from specctl.net.protocol import Done
from specctl.spec.params import SamplingParams
from specctl.verify.client import RemoteError

HEALTH_GENERATE_TIMEOUT_S = 30.0  # /health_generate's token: a target stalled longer than this is unhealthy


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

