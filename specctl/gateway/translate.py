"""A validated request (gateway.api) in the engine's terms: its prompts, its chat turns as the
chat template takes them, and its sampling parameters — with the limits of gateway.api and
the context's room checked on the way, each failure an ApiError naming its parameter."""

from __future__ import annotations

from typing import Any

import msgspec

from specctl.engine.stop_regex import compile_stop_patterns
from specctl.engine.text import bad_word_sequences, longest_token_chars
from specctl.errors import BadRequest, SpecctlError
from specctl.gateway.api import (
    MAX_CHOICES, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, ApiError, ChatCompletionRequest, ChatMessage,
    CompletionRequest, RequestFields,
)
from specctl.gateway.llama_samplers import sampler_chain
from specctl.gateway.request_checks import scored_prompt, wanted_logprobs
from specctl.spec.params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, SamplingParams


def completion_prompts(prompt: str | list) -> list[str | list[int]]:
    """A completion request's prompts: one text, one list of token ids, or a batch of either
    (OpenAI's four shapes; a batch's prompts are one shape)."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        if len(prompt) > MAX_CHOICES:
            raise ApiError(400, f"at most {MAX_CHOICES} prompts a request, got {len(prompt)}", param="prompt")
        return list(prompt)
    raise ApiError(400, "prompt must be a string, a list of token ids, or a list of strings or of token-id lists "
                        "(one shape per batch)", param="prompt")


def truncated(prompts: list[list[int]], keep: int | None, context: int) -> list[list[int]]:
    """vLLM's truncate_prompt_tokens: each prompt's last ``keep`` tokens (-1: the context's worth)."""
    if keep is None:
        return prompts
    if keep == 0 or keep < -1:
        raise ApiError(400, f"truncate_prompt_tokens must be at least 1 (or -1: as many as the context holds), got "
                            f"{keep}", param="truncate_prompt_tokens")
    if keep > context:
        raise ApiError(400, f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({context}). Please, "
                            f"select a smaller truncation size.", param="truncate_prompt_tokens")
    keep = context if keep == -1 else keep
    return [p[-keep:] for p in prompts]


def bad_words(words: list[str] | None, tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences (engine.text.bad_word_sequences)."""
    try:
        sequences = bad_word_sequences(tokenizer, words or [])
    except BadRequest as exc:
        raise ApiError(400, str(exc), param="bad_words") from None
    if len(sequences) > MAX_BAD_WORDS or any(len(s) > MAX_BAD_WORD_TOKENS for s in sequences):
        raise ApiError(400, f"bad_words may bar at most {MAX_BAD_WORDS} token sequences (a word counts once or twice: "
                            f"as written and after a space) of at most {MAX_BAD_WORD_TOKENS} tokens each",
                       param="bad_words")
    return sequences


def prediction_tokens(req: RequestFields, tokenizer: Any, context: int) -> tuple[int, ...]:
    """OpenAI's prediction as the token ids the target drafts from (spec.prediction)."""
    if req.prediction is None:
        return ()
    if req.prediction.type != "content":
        raise ApiError(400, f"prediction.type must be 'content', got {req.prediction.type!r}", param="prediction")
    content = req.prediction.content
    if not isinstance(content, str):
        kinds = {part.type for part in content} - {"text"}
        if kinds:
            raise ApiError(400, f"prediction.content parts must be text, got {sorted(kinds)}", param="prediction")
        content = "".join(part.text for part in content)
    if len(content) > context * longest_token_chars(tokenizer):  # cannot fit: not worth tokenizing
        raise ApiError(400, f"prediction is {len(content)} characters, longer than the model's context ({context} "
                            "tokens) however it is split: give the part of the answer you expect", param="prediction")
    tokens = tuple(tokenizer.encode(content, add_special_tokens=False))
    if len(tokens) > context:
        raise ApiError(400, f"prediction is {len(tokens)} tokens, longer than the model's context ({context}): "
                            "give the part of the answer you expect", param="prediction")
    return tokens


def logit_bias(req: RequestFields) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (token ids as strings -> -100..100) as (id, bias) pairs; the target
    instance refuses ids past its vocabulary."""
    pairs = []
    for key, bias in (req.logit_bias or {}).items():
        if not key.strip().isdigit():
            raise ApiError(400, f"logit_bias keys are token ids, got {key!r}", param="logit_bias")
        pairs.append((int(key), bias))
    return tuple(sorted(pairs))


def allowed_tokens(req: RequestFields) -> tuple[int, ...]:
    """vLLM's allowed_token_ids (each once, in order); the target instance refuses ids past its
    vocabulary. An empty list would leave no token to sample: refused."""
    if req.allowed_token_ids is not None and not req.allowed_token_ids:
        raise ApiError(400, "allowed_token_ids must not be empty: leave it out to allow every token",
                       param="allowed_token_ids")
    return tuple(dict.fromkeys(req.allowed_token_ids or ()))


def stop_strings(req: RequestFields) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    if (chars := sum(map(len, stop))) > MAX_STOP_CHARS:
        raise ApiError(400, f"stop strings may hold {MAX_STOP_CHARS:,} characters in all, got {chars:,}", param="stop")
    return [s for s in stop if s]


def stop_patterns(req: RequestFields) -> tuple:
    """SGLang's stop_regex, compiled (engine.stop_regex); a 400 naming what is wrong with it."""
    try:
        return compile_stop_patterns(req.stop_regex)
    except BadRequest as exc:
        raise ApiError(400, str(exc), param="stop_regex") from None


def message_text(message: ChatMessage) -> str:
    """A chat message's text: its content, or its text parts joined (other parts are a 400)."""
    content = message.content
    if isinstance(content, list):
        if any(part.type != "text" for part in content):
            raise ApiError(400, "only text content parts are supported", param="messages")
        content = "".join(part.text for part in content)
    return content or ""


def prompt_only(req: RequestFields) -> bool:
    """echo with max_tokens 0: the prompt alone, scored (OpenAI's legacy completions, vLLM; lm-eval
    asks this way): the target is asked for one token, which the answer leaves out (choices)."""
    return isinstance(req, CompletionRequest) and req.echo and req.max_tokens == 0


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    if not req.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    out = []
    for i, message in enumerate(req.messages):
        if message.role not in ("system", "user", "assistant", "developer", "tool"):
            raise ApiError(400, f"unknown message role {message.role!r}", param="messages")
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            # OpenAI's rule (vLLM would read an empty text): only an assistant turn that called tools may leave it out
            needs = "an assistant message needs content or tool_calls" if message.role == "assistant" else \
                f"a {message.role} message needs content"
            raise ApiError(400, f"messages[{i}] ({message.role}) has no content: {needs}",
                           param=f"messages[{i}].content")
        turn = {"role": "system" if message.role == "developer" else message.role, "content": message_text(message)}
        if message.tool_calls:
            turn["tool_calls"] = [{"type": "function", "function": {"name": call.function.name,
                                                                    "arguments": _arguments(call.function.arguments)}}
                                  for call in message.tool_calls]
        if message.tool_call_id is not None:
            turn["tool_call_id"] = message.tool_call_id
        out.append(turn)
    return out


# apply_chat_template's own arguments and the variables the gateway sets: not a request's to set
TEMPLATE_RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's


def template_variables(req: ChatCompletionRequest) -> dict[str, Any]:
    """The chat template's own variables a request sets: chat_template_kwargs, and
    reasoning_effort as vLLM passes it (``none`` also turns Qwen3-style ``enable_thinking``
    off, unless chat_template_kwargs sets it)."""
    extra = req.chat_template_kwargs or {}
    for key in extra:
        if key in TEMPLATE_RESERVED or not key.isidentifier():
            raise ApiError(400, f"chat_template_kwargs cannot set {key!r}: the gateway sets it (or it is no "
                                f"template variable); use the request's own field", param="chat_template_kwargs")
    effort = getattr(req, "reasoning_effort", None)
    if effort is None:
        return extra
    if effort not in REASONING_EFFORTS:
        raise ApiError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                       param="reasoning_effort")
    return {"reasoning_effort": effort, **({"enable_thinking": False} if effort == "none" else {}), **extra}


def chat_template_options(req: ChatCompletionRequest) -> dict[str, Any]:
    """vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs (with
    reasoning_effort) as the chat template's keyword arguments (engine.text.encode_chat)."""
    if req.add_generation_prompt and req.continue_final_message:
        raise ApiError(400, "continue_final_message leaves the last message open for the model to continue; it "
                            "cannot go with add_generation_prompt, which starts a new one: set that to false",
                       param="continue_final_message")
    return {**template_variables(req), "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message}


def _arguments(arguments: str) -> Any:
    """A call's arguments as the chat template renders them (an object, not its JSON text)."""
    try:
        return msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        raise ApiError(400, f"a tool call's arguments must be JSON, got {arguments!r}", param="messages") from None


def penalty_window(repeat_last_n: int | None, context: int) -> tuple[int, bool]:
    """llama.cpp's ``repeat_last_n`` as (SamplingParams.penalty_last_n, whether penalties apply):
    left out, vLLM's penalties; -1 the whole text (the context's worth); 0 none at all."""
    if repeat_last_n is None:
        return 0, True
    if repeat_last_n < -1:
        raise ApiError(400, f"repeat_last_n must be -1 (the whole text), 0 (no penalties) or more, got {repeat_last_n}",
                       param="repeat_last_n")
    return (context if repeat_last_n == -1 else min(repeat_last_n, context)), repeat_last_n != 0


def sampling_params(req: RequestFields, prompt_tokens: int, context: int, default_max_tokens: int,
                    structured: tuple[str, str] | None = None,
                    barred: tuple[tuple[int, ...], ...] = (), defaults: dict | None = None,
                    ends: tuple[int, ...] = (), prediction: tuple[int, ...] = (),
                    thinking: tuple | None = None) -> SamplingParams:
    """Validated sampling parameters; a prompt that leaves no room is a 400 as in OpenAI. Stop
    token ids outside the vocabulary are refused by the target instance (a 400 too).
    ``structured``: the request's grammar (gateway.structured), checked already; ``barred``: its
    bad_words as token sequences (``bad_words``); ``defaults``: what the fields a request leaves
    out take (gateway.sampling_defaults; OpenAI's where it says nothing); ``ends``: stop token
    ids the request implies besides its own (an infill's, engine.fim); ``prediction``: its
    prediction's token ids (``prediction_tokens``); ``thinking``: its thinking budget
    (gateway.reasoning.thinking_budget)."""
    defaults = defaults or {}
    if req.stop_token_ids and len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(400, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(req.stop_token_ids)}",
                       param="stop_token_ids")
    room = context - prompt_tokens
    name = ("max_completion_tokens" if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None
            else "max_tokens")
    requested = getattr(req, name)
    if prompt_only(req):
        requested = 1
    elif requested is not None and requested < 1:
        raise ApiError(400, f"{name} must be at least 1, got {requested}", param=name)
    if room < 1 or (requested is not None and requested > room):
        raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                       f"{prompt_tokens + (requested or 1)} tokens ({prompt_tokens} in the messages/prompt, "
                       f"{requested or 1} in the completion). Please reduce the length of the prompt or max_tokens.",
                       param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                       code="context_length_exceeded")
    if requested is None:
        fallback = 16 if isinstance(req, CompletionRequest) else default_max_tokens
        requested = min(defaults.get("max_tokens", fallback), room)
    top_k = req.top_k if req.top_k is not None else defaults.get("top_k", 0)
    top_k = 0 if top_k == -1 else top_k

    def given(value, name: str, openai: float) -> float:
        return value if value is not None else defaults.get(name, openai)

    window, penalized = penalty_window(req.repeat_last_n, context)
    if req.cache_salt is not None and not req.cache_salt:
        raise ApiError(400, "cache_salt must be a non-empty string if given (vLLM's rule): leave it out to share the "
                            "prefix cache", param="cache_salt")
    chain = sampler_chain(req.samplers) if req.samplers is not None else None

    try:
        params = SamplingParams(
            temperature=given(req.temperature, "temperature", 1.0), top_p=given(req.top_p, "top_p", 1.0),
            top_k=top_k, max_tokens=requested, seed=req.seed, ignore_eos=req.ignore_eos,
            stop_token_ids=tuple(dict.fromkeys((*(req.stop_token_ids or ()), *ends))), logprobs=wanted_logprobs(req),
            prompt_logprobs=scored_prompt(req),
            presence_penalty=(req.presence_penalty or 0.0) * penalized,
            frequency_penalty=(req.frequency_penalty or 0.0) * penalized,
            repetition_penalty=given(req.repetition_penalty, "repetition_penalty", 1.0) if penalized else 1.0,
            penalty_last_n=window,
            min_p=given(req.min_p, "min_p", 0.0), min_tokens=req.min_tokens or 0,
            logit_bias=logit_bias(req), structured=structured, bad_words=barred, allowed_token_ids=allowed_tokens(req),
            cache_salt=req.cache_salt or "", prediction=prediction, prompt_progress=req.stream and req.return_progress,
            **({} if thinking is None else dict(zip(("thinking_budget", "thinking_markers"), thinking))),
        )
        return chain.applied(params) if chain is not None else params  # a sampler left out of the list is off
    except SpecctlError as exc:  # the message starts with the parameter's name
        raise ApiError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None
