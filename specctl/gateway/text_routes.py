"""The gateway's endpoints that generate nothing: vLLM's /tokenize and /detokenize (which
take llama.cpp's shapes too), llama.cpp's /apply-template and /props, SGLang's
/get_model_info and /get_server_info. Prompts and messages are encoded exactly as the generation endpoints
encode them."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, ClassVar

import msgspec
from aiohttp import web

from specctl import __version__
from specctl.engine.text import render_chat
from specctl.errors import BadRequest
from specctl.gateway.llama_samplers import DEFAULT_SAMPLERS
from specctl.gateway.api import (
    ApiError, ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest, TokenizeRequest,
)
from specctl.gateway.request_body import check_key, parse_body
from specctl.gateway.request_checks import check_prompt_chars
from specctl.gateway.translate import chat_messages, chat_template_options
from specctl.gateway.role_stats import recent_rate

if TYPE_CHECKING:
    from specctl.gateway.server import Gateway


class TemplateRequest(msgspec.Struct, kw_only=True):
    """llama.cpp's /apply-template: chat messages, rendered by the model's chat template."""
    endpoint: ClassVar[str] = "/apply-template"  # named in the log of fields it ignores
    messages: list[ChatMessage]
    model: str | None = None
    tools: list | None = None
    chat_template_kwargs: dict | None = None


class TextRoutes:
    def __init__(self, gateway: "Gateway") -> None:
        self.gateway = gateway
        self.generations, self.config, self.tokenizer = gateway.generations, gateway.config, gateway.tokenizer

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize),
                web.post("/apply-template", self.apply_template), web.get("/props", self.props),
                web.get("/get_model_info", self.model_info), web.get("/get_server_info", self.server_info),
                web.get("/server_info", self.server_info)]

    async def _parsed(self, request: web.Request, kind: type) -> object:
        check_key(request, self.config.api_key)
        req = parse_body(await request.read(), kind)
        self.generations.check_model(req.model)
        return req

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: the ids a prompt (or chat messages) becomes, as generation encodes
        it; llama.cpp's (``content``): the text's ids alone, or with their pieces."""
        req = await self._parsed(request, TokenizeRequest)
        if sum(given is not None for given in (req.prompt, req.messages, req.content)) != 1:
            raise ApiError(400, "give one of prompt, messages (vLLM's) or content (llama.cpp's)", param="prompt")
        if req.content is not None:
            check_prompt_chars(len(req.content), self.tokenizer, self.config.context, "content")
            ids = await self.generations.off_loop(lambda: self.tokenizer.encode(req.content,
                                                                                add_special_tokens=req.add_special))
            pieces = [{"id": i, "piece": self.tokenizer.decode([i])} for i in ids] if req.with_pieces else ids
            return web.json_response({"tokens": pieces})
        chat = req.messages is not None
        parsed = (ChatCompletionRequest(messages=req.messages, tools=req.tools,
                                        add_generation_prompt=req.add_generation_prompt,
                                        continue_final_message=req.continue_final_message,
                                        chat_template_kwargs=req.chat_template_kwargs) if chat
                  else CompletionRequest(prompt=req.prompt))
        [ids] = await self.generations.off_loop(lambda: self.generations.encode(parsed, self.generations.tools(parsed)))
        body = {"count": len(ids), "max_model_len": self.config.context, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return web.json_response(body)

    async def detokenize(self, request: web.Request) -> web.Response:
        """The text of token ids: vLLM's ``prompt``, and llama.cpp's ``content``."""
        req = await self._parsed(request, DetokenizeRequest)
        vocab = len(self.tokenizer)
        if req.tokens and (min(req.tokens) < 0 or max(req.tokens) >= vocab):
            raise ApiError(400, f"token ids must be in [0, {vocab}), got {min(req.tokens)}..{max(req.tokens)}",
                           param="tokens")
        text = await self.generations.off_loop(self.tokenizer.decode, req.tokens)
        return web.json_response({"prompt": text, "content": text})

    async def apply_template(self, request: web.Request) -> web.Response:
        """llama.cpp's /apply-template: the prompt text chat messages make, ready for the
        assistant's turn (to edit and send to /completion)."""
        req = await self._parsed(request, TemplateRequest)
        chat = ChatCompletionRequest(messages=req.messages, tools=req.tools,
                                     chat_template_kwargs=req.chat_template_kwargs)
        try:
            prompt = render_chat(self.tokenizer, chat_messages(chat), self.generations.tools(chat),
                                 chat_template_options(chat))
        except BadRequest as exc:
            raise ApiError(400, str(exc), param="messages") from None
        return web.json_response({"prompt": prompt})

    async def props(self, request: web.Request) -> web.Response:
        """llama.cpp's GET /props: the defaults /completion serves, the context, the sessions the
        target instances hold in all (its slots), the model and its chat template."""
        check_key(request, self.config.api_key)
        slots = sum(view.capacity for view in self.gateway.upstream.views() if view.up)
        params = {"n_predict": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": -1,
                  "repeat_penalty": 1.0, "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                  "stop": [], "samplers": list(DEFAULT_SAMPLERS)}
        return web.json_response({
            "default_generation_settings": {"n_ctx": self.config.context, "speculative": True, "params": params},
            "total_slots": slots, "model_path": self.config.names[0], "modalities": {"vision": False, "audio": False},
            "chat_template": getattr(self.tokenizer, "chat_template", None) or "", "build_info": f"specctl {__version__}"})

    async def model_info(self, _request: web.Request) -> web.Response:
        """SGLang's GET /get_model_info."""
        return web.json_response({"model_path": self.config.names[0], "tokenizer_path": self.config.names[0],
                                  "is_generation": True, "max_model_len": self.config.context})

    async def server_info(self, request: web.Request) -> web.Response:
        """SGLang's GET /get_server_info (and /server_info): the serving settings, and per target
        instance its ``internal_states`` — the tokens a second it generated over the last 10 s
        (``last_gen_throughput``) and its mean accepted length since it started
        (``avg_spec_accept_length``: tokens a verification commits, the bonus included), which
        SGLang's bench_serving prints as the accept length."""
        check_key(request, self.config.api_key)
        now = time.time()
        states = [{"address": link.address, "up": link.up,
                   "last_gen_throughput": round(recent_rate(link.generated, now), 3),
                   "avg_spec_accept_length": link.stats.get("mean_accepted_length") if link.stats.get("rounds") else None,
                   "num_running_reqs": link.stats.get("sessions", 0)}
                  for link in self.gateway.upstream.targets]
        return web.json_response({
            "model_path": self.config.names[0], "tokenizer_path": self.config.names[0],
            "served_model_name": self.config.names[0], "context_length": self.config.context,
            "speculative_algorithm": "specctl", "version": __version__, "internal_states": states})
