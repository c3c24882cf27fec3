"""llama.cpp's own completion API, which its clients and editor plugins call: ``POST
/completion`` (also ``/completions``); ``/infill`` shares its options (gateway.infill).

A request becomes the OpenAI completion it amounts to — its prompt as token ids, llama.cpp's
sampling defaults where it leaves them out (temperature 0.8, top-k 40, top-p 0.95, min-p
0.05), ``n_predict`` -1 (its default) to the end of the context, 0 to evaluate the prompt
into the prefix cache only — and is answered in llama.cpp's shape (gateway.llama_reply).

The prompt may be text, token ids, or both mixed (``[12, 34, "text", 56]``; BOS where the
prompt starts with text and the tokenizer adds one), or a list of such prompts, answered as
a list. ``grammar`` (GBNF) and ``json_schema`` hold the output as vLLM's guided_grammar and
guided_json do; ``repeat_penalty``, ``presence_penalty`` and ``frequency_penalty`` count the text's last
``repeat_last_n`` tokens (64 by default; -1 all of it, 0 no penalties), the prompt's included,
as llama.cpp's penalties sampler does; ``samplers`` orders them as llama.cpp does, temperature
last by default (gateway.llama_samplers); a ``logit_bias`` of ``false`` is -100. Its samplers
not served here (typical, Mirostat, DRY, XTC, dynamic temperature, top-n-sigma) are refused
when set rather than ignored. The
editor plugins' ``n_indent``, ``t_max_predict_ms`` and ``response_fields`` are honoured as
llama.cpp honours them."""

from __future__ import annotations

import json
import time
from typing import Any, ClassVar

import msgspec

from specctl.engine.text import encode_prompt
from specctl.gateway.request_checks import check_prompt_chars
from specctl.gateway.api import MAX_CHOICES, ApiError, CompletionRequest
from specctl.gateway.request_body import parse_body
from specctl.gateway.llama_reply import LlamaReply, Probabilities, Rules
from specctl.gateway.llama_samplers import DEFAULT_SAMPLERS, sampler_chain
from specctl.spec.params import MAX_LOGPROBS

BANNED_BIAS = -100.0  # a logit_bias of false: OpenAI's lowest bias, which no token overcomes
# llama.cpp's samplers this gateway does not serve: (option, its "off" value, what it is). Set to
# anything else, a request is refused rather than answered by other sampling than it asked for
# (as best_of is on the OpenAI routes).
UNSERVED_SAMPLERS = (("typical_p", 1.0, "locally typical sampling"), ("mirostat", 0, "Mirostat"),
                     ("dry_multiplier", 0.0, "DRY"), ("xtc_probability", 0.0, "XTC"),
                     ("dynatemp_range", 0.0, "dynamic temperature"), ("top_n_sigma", -1.0, "top-n-sigma"))


class LlamaOptions(msgspec.Struct, kw_only=True):
    """The options of llama.cpp's /completion this gateway serves (others are ignored, named
    once in the log)."""
    model: str | None = None
    n_predict: int = -1
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1  # -1: a random one
    stop: list[str] = []
    stream: bool = False
    return_progress: bool = False  # streamed: prompt_progress events while the prompt is read
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64  # the penalties' window over the text's last tokens (-1: all; 0: no penalties)
    # the order they apply in: temperature last (gateway.llama_samplers)
    samplers: list[str] | str = msgspec.field(default_factory=lambda: list(DEFAULT_SAMPLERS))
    logit_bias: list[list[Any]] | dict[str, Any] | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    n_probs: int = 0  # each token's likeliest alternatives (completion_probabilities)
    post_sampling_probs: bool = False  # probabilities rather than log-probabilities there
    return_tokens: bool = False
    n_indent: int = 0  # a later line indented less ends the text (code completion)
    t_max_predict_ms: float = 0.0  # past this since the first token, the next newline ends the text (0: off)
    response_fields: list[str] | None = None  # only these fields, "a/b" lifted out of "a" under that name
    # llama.cpp's samplers not served here, at their "off" values (refused when set: UNSERVED_SAMPLERS)
    typical_p: float = 1.0
    mirostat: int = 0
    dry_multiplier: float = 0.0
    xtc_probability: float = 0.0
    dynatemp_range: float = 0.0
    top_n_sigma: float = -1.0


class LlamaCompletionRequest(LlamaOptions, kw_only=True):
    endpoint: ClassVar[str] = "/completion"  # named in the log of fields it ignores
    prompt: str | list[int | str | list[int | str]]


def parse_completion(body: bytes, tokenizer: Any, context: int, model: str) -> tuple[CompletionRequest, LlamaReply]:
    """A /completion body as the completion request it amounts to, and what answers it."""
    started = time.perf_counter()
    asked = parse_body(body, LlamaCompletionRequest)
    prompts, listed = llama_prompts(asked.prompt, tokenizer, context)
    req = completion_request(asked, prompts, context)
    return req, llama_reply(asked, req, prompts, listed, model, context, started, tokenizer)


def llama_reply(asked: LlamaOptions, req: CompletionRequest, prompts: list[list[int]], listed: bool, model: str,
                context: int, started: float, tokenizer: Any) -> LlamaReply:
    """The reply to ``asked``, served as ``req``."""
    if asked.n_indent < 0 or asked.t_max_predict_ms < 0:
        raise ApiError(400, "n_indent and t_max_predict_ms must be >= 0", param="n_indent")
    rules = Rules(asked.n_indent, asked.t_max_predict_ms / 1e3, asked.n_predict == 0)
    probabilities = Probabilities(tokenizer, asked.post_sampling_probs) if asked.n_probs else None
    return LlamaReply(model, prompts, listed, asked.return_tokens, generation_settings(req, asked, model, context),
                      started, rules, asked.response_fields, probabilities)


def llama_prompts(prompt: str | list, tokenizer: Any, context: int) -> tuple[list[list[int]], bool]:
    """The prompts as token ids, and whether they came as a list of prompts (answered as a list)."""
    if isinstance(prompt, str):
        return [_mixed([prompt], tokenizer, context)], False
    if prompt and (all(isinstance(p, str) for p in prompt) or any(isinstance(p, list) for p in prompt)):
        if any(isinstance(p, int) for p in prompt):
            raise ApiError(400, "a list of prompts holds strings or lists, not bare token ids", param="prompt")
        if len(prompt) > MAX_CHOICES:
            raise ApiError(400, f"at most {MAX_CHOICES} prompts a request, got {len(prompt)}", param="prompt")
        return [_mixed([p] if isinstance(p, str) else p, tokenizer, context) for p in prompt], True
    return [_mixed(prompt, tokenizer, context)], False


def _mixed(pieces: list[int | str], tokenizer: Any, context: int) -> list[int]:
    """Token ids and text pieces, as llama.cpp joins them: BOS only before a leading text."""
    check_prompt_chars(sum(len(piece) for piece in pieces if isinstance(piece, str)), tokenizer, context)
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            ids += encode_prompt(tokenizer, piece) if i == 0 else tokenizer.encode(piece, add_special_tokens=False)
        else:
            ids.append(piece)
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return ids


def completion_request(asked: LlamaOptions, prompts: list[list[int]], context: int,
                       ends: tuple[int, ...] = ()) -> CompletionRequest:
    """The OpenAI completion request ``asked`` amounts to (``ends``: stop token ids it implies)."""
    if asked.n_predict < -1:
        raise ApiError(400, f"n_predict must be -1 (to the end of the context), 0 (evaluate the prompt only) or "
                            f"more, got {asked.n_predict}", param="n_predict")
    if not 0 <= asked.n_probs <= MAX_LOGPROBS:
        raise ApiError(400, f"n_probs must be between 0 and {MAX_LOGPROBS}, got {asked.n_probs}", param="n_probs")
    if asked.grammar is not None and asked.json_schema is not None:
        raise ApiError(400, "give grammar or json_schema, not both", param="grammar")
    for name, off, sampler in UNSERVED_SAMPLERS:
        if getattr(asked, name) != off:
            raise ApiError(400, f"{name} {getattr(asked, name)} asks for {sampler}, which specctl does not serve: leave "
                                f"it out (or {off}); temperature, top_k, top_p, min_p, the penalties, logit_bias and "
                                "grammars are served", param=name)
    room = max(1, context - max(map(len, prompts)))  # a prompt past the context: the completion's own 400 says so
    return CompletionRequest(
        # n_predict 0: one token, not handed out — the prompt is evaluated into the target's prefix cache
        model=asked.model, prompt=prompts if len(prompts) > 1 else prompts[0],
        max_tokens=room if asked.n_predict == -1 else max(1, asked.n_predict),
        temperature=asked.temperature, top_k=asked.top_k, top_p=asked.top_p, min_p=asked.min_p,
        seed=None if asked.seed == -1 else asked.seed, stop=asked.stop or None, ignore_eos=asked.ignore_eos,
        stream=asked.stream, return_progress=asked.return_progress,
        presence_penalty=asked.presence_penalty, frequency_penalty=asked.frequency_penalty,
        repetition_penalty=asked.repeat_penalty, repeat_last_n=asked.repeat_last_n, samplers=asked.samplers,
        logit_bias=openai_bias(asked.logit_bias),
        guided_grammar=asked.grammar, guided_json=asked.json_schema, stop_token_ids=list(ends) or None,
        logprobs=asked.n_probs or None)


def openai_bias(bias: list[list[Any]] | dict[str, Any] | None) -> dict[str, float] | None:
    """llama.cpp's ``[[id, bias], ...]`` or ``{"id": bias}`` (``false``: never) as OpenAI's map."""
    if not bias:
        return None
    pairs = bias.items() if isinstance(bias, dict) else bias
    found: dict[str, float] = {}
    for pair in pairs:
        if len(pair) != 2 or isinstance(pair[1], str):
            raise ApiError(400, "logit_bias entries are [token id, bias or false]", param="logit_bias")
        token, value = pair
        if value is True or not isinstance(value, (int, float)):
            raise ApiError(400, f"a logit_bias is a number or false, got {json.dumps(value)}", param="logit_bias")
        if isinstance(token, str) and not token.strip().isdigit():
            raise ApiError(400, f"logit_bias by text ({token!r}) is not served here: give token ids (POST /tokenize "
                                "turns text into them)", param="logit_bias")
        if not isinstance(token, (int, str)) or isinstance(token, bool):
            raise ApiError(400, f"a logit_bias token is a token id, got {json.dumps(token)}", param="logit_bias")
        found[str(int(token))] = BANNED_BIAS if value is False else float(value)
    return found


def generation_settings(req: CompletionRequest, asked: LlamaOptions, model: str, context: int) -> dict:
    """llama.cpp's generation_settings: the options as this request is served."""
    return {"n_ctx": context, "model": model, "n_predict": req.max_tokens, "temperature": req.temperature,
            "top_k": req.top_k, "top_p": req.top_p, "min_p": req.min_p, "seed": asked.seed, "stop": asked.stop,
            "ignore_eos": asked.ignore_eos, "presence_penalty": asked.presence_penalty,
            "frequency_penalty": asked.frequency_penalty, "repeat_penalty": asked.repeat_penalty,
            "repeat_last_n": asked.repeat_last_n, "samplers": list(sampler_chain(asked.samplers).names),
            "stream": asked.stream, "speculative": True}
