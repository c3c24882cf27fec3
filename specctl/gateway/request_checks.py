"""The checks of a parsed OpenAI request that span its fields: what it may ask together, how
many logprobs it wants and how many the scoring pass over its prompt lists (gateway.api holds
the bodies, gateway.translate puts a checked one in the engine's terms)."""

from __future__ import annotations

from typing import Any

from specctl.engine.text import longest_token_chars
from specctl.gateway.api import MAX_CHOICES, ApiError, ChatCompletionRequest, CompletionRequest, RequestFields
from specctl.spec.params import MAX_LOGPROBS


def refuse_unsupported(req: RequestFields) -> None:
    if not 1 <= req.n <= MAX_CHOICES:
        raise ApiError(400, f"n must be between 1 and {MAX_CHOICES}, got {req.n}", param="n")
    wanted_logprobs(req)  # refuses values out of range
    scored_prompt(req)
    if req.functions:
        raise ApiError(400, "functions are not supported: send them as tools", param="functions")
    if req.use_beam_search:
        raise ApiError(400, "beam search is not served: speculative decoding gives the target's own greedy or "
                            "sampled text (n choices sample n texts)", param="use_beam_search")
    if req.prompt_embeds is not None:
        raise ApiError(400, "prompt_embeds are not served: give the prompt as text or token ids", param="prompt_embeds")
    if req.tools and not isinstance(req, ChatCompletionRequest):
        raise ApiError(400, "tools are for chat completions", param="tools")
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, req.n):
            raise ApiError(400, "best_of is not supported (only equal to n): every choice generated is returned",
                           param="best_of")
        if req.suffix is not None and req.echo:
            raise ApiError(400, "echo cannot go with suffix: an infill's prompt is the prefix and the suffix "
                                "around the answer, not text before it", param="echo")
        if req.suffix is not None and req.truncate_prompt_tokens is not None:
            raise ApiError(400, "truncate_prompt_tokens cannot go with suffix (it would cut the infill's markers): "
                                "shorten the prompt", param="truncate_prompt_tokens")


def wanted_logprobs(req: RequestFields) -> int | None:
    """How many alternatives each token's logprobs list, or None when the request wants no
    logprobs: completions ask with ``logprobs: n``; chat with ``logprobs: true`` and
    ``top_logprobs: n`` (OpenAI's two shapes)."""
    if isinstance(req, ChatCompletionRequest):
        if not isinstance(req.logprobs, (bool, type(None))):
            raise ApiError(400, "logprobs must be true or false for chat; top_logprobs gives the alternatives",
                           param="logprobs")
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        wanted, name = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
    else:
        if isinstance(req.logprobs, bool) or req.top_logprobs is not None:
            raise ApiError(400, "logprobs for completions is the number of alternatives (0-20); top_logprobs is "
                                "for chat", param="logprobs")
        wanted, name = req.logprobs, "logprobs"
    if wanted is not None and not 0 <= wanted <= MAX_LOGPROBS:
        raise ApiError(400, f"{name} must be between 0 and {MAX_LOGPROBS}, got {wanted}", param=name)
    return wanted


def scored_prompt(req: RequestFields) -> int | None:
    """How many alternatives the scoring pass over the prompt lists (None: no pass): for vLLM's
    prompt_logprobs and for an echoed prompt's logprobs, the more of the two."""
    if req.prompt_logprobs is not None:
        if not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {req.prompt_logprobs}",
                           param="prompt_logprobs")
        if req.stream:
            raise ApiError(400, "prompt_logprobs are not available when stream is true (as in vLLM): ask without "
                                "stream, or use echo with logprobs (completions), which streams",
                           param="prompt_logprobs")
    echoed = wanted_logprobs(req) if isinstance(req, CompletionRequest) and req.echo else None
    return max((k for k in (req.prompt_logprobs, echoed) if k is not None), default=None)


def check_prompt_chars(chars: int, tokenizer: Any, context: int, param: str = "prompt") -> None:
    """Refuse a prompt of ``chars`` characters that cannot fit in the context however it
    tokenizes, before it is tokenized: encoding costs about 0.7 KB and 3 us a token (a 60 MB
    prompt took 50 s and 8 GB of the gateway's memory only to be refused after)."""
    longest = longest_token_chars(tokenizer)
    if chars > context * longest:
        raise ApiError(400, f"This model's maximum context length is {context} tokens. However, the prompt is "
                            f"{chars} characters: more than {context} tokens however it is split (a token of this "
                            f"model is at most {longest} characters). Please reduce the length of the prompt.",
                       param=param, code="context_length_exceeded")
