"""A request's sampling parameters on the wire (GENERATE) and back, both directions in one
place: a field added to SamplingParams either travels or fails the round-trip test."""

from __future__ import annotations

from specctl.net.protocol import Generate
from specctl.spec.params import SamplingParams


def generate_message(req: int, prompt: list[int], params: SamplingParams, request_id: str = "",
                     resumed: list[int] | tuple[int, ...] = ()) -> Generate:
    """``resumed``: the output a lost instance already sent (Generate.resumed)."""
    return Generate(
        req, prompt, params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed,
        list(params.stop_token_ids), params.ignore_eos,
        logprobs=-1 if params.logprobs is None else params.logprobs,
        prompt_logprobs=-1 if params.prompt_logprobs is None else params.prompt_logprobs,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, min_p=params.min_p, min_tokens=params.min_tokens,
        logit_bias=dict(params.logit_bias), bad_words=[list(word) for word in params.bad_words],
        structured_kind=params.structured[0] if params.structured else "",
        structured_spec=params.structured[1] if params.structured else "",
        request_id=request_id, penalty_last_n=params.penalty_last_n,
        allowed_token_ids=list(params.allowed_token_ids), sampler_order=list(params.sampler_order),
        cache_salt=params.cache_salt, prediction=list(params.prediction),
        thinking_budget=-1 if params.thinking_budget is None else params.thinking_budget,
        thinking_start=list(params.thinking_markers[0]) if params.thinking_markers else [],
        thinking_end=list(params.thinking_markers[1]) if params.thinking_markers else [],
        resumed=list(resumed), return_progress=params.prompt_progress,
    )


def sampling_params_of(msg: Generate) -> SamplingParams:
    """The request's parameters, validated (InvalidSamplingParams names the bad one)."""
    return SamplingParams(
        temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k, max_tokens=msg.max_tokens, seed=msg.seed,
        stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        logprobs=None if msg.logprobs < 0 else msg.logprobs,
        prompt_logprobs=None if msg.prompt_logprobs < 0 else msg.prompt_logprobs,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty, min_p=msg.min_p, min_tokens=msg.min_tokens,
        logit_bias=tuple(sorted(msg.logit_bias.items())), bad_words=tuple(map(tuple, msg.bad_words)),
        structured=(msg.structured_kind, msg.structured_spec) if msg.structured_kind else None,
        penalty_last_n=msg.penalty_last_n, allowed_token_ids=tuple(msg.allowed_token_ids),
        sampler_order=tuple(msg.sampler_order), cache_salt=msg.cache_salt, prediction=tuple(msg.prediction),
        thinking_budget=None if msg.thinking_budget < 0 else msg.thinking_budget,
        thinking_markers=((tuple(msg.thinking_start), tuple(msg.thinking_end))
                          if msg.thinking_start or msg.thinking_end else ()),
        prompt_progress=msg.return_progress,
    )
