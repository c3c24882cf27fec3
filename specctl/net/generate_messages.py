"""The messages between a client (a gateway, ``specctl generate``) and a target: a generation
asked, its tokens as they come, its end, its cancellation. Members of net.protocol's one
tagged union."""

from __future__ import annotations

from typing import Annotated

import msgspec

# A gateway's request id (gateway.request_id) as the target logs it: one line, bounded ("" = none); the
# gateway takes ids of up to 256 characters and names a request's choices "<id>-<index>" (index < 128).
RequestId = Annotated[str, msgspec.Meta(max_length=320, pattern=r"^[\x21-\x7e]*$")]


class Generate(msgspec.Struct, tag=True, frozen=True):
    req: int
    prompt: list[int]
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int = -1  # -1: none; n >= 0: each token's log-probability and its n likeliest alternatives
    prompt_logprobs: int = -1  # the same for the prompt's tokens after the first (sent with the first TOKENS)
    presence_penalty: float = 0.0  # spec.logit_rules
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = {}
    structured_kind: str = ""  # spec.structured: "" = unconstrained, else its kind and text
    structured_spec: str = ""
    bad_words: list[list[int]] = []  # vLLM's, as token sequences (spec.logit_rules)
    request_id: RequestId = ""  # the gateway's request id (a choice's: "<id>-<index>"), named in the target's log lines
    penalty_last_n: int = 0  # SamplingParams.penalty_last_n (0 from older peers: vLLM's penalties)
    allowed_token_ids: list[int] = []  # vLLM's: only these may come (empty: any)
    sampler_order: list[str] = []  # SamplingParams.sampler_order (empty from older peers: temperature first)
    cache_salt: str = ""  # SamplingParams.cache_salt (the prefix cache's namespace)
    prediction: list[int] = []  # SamplingParams.prediction (OpenAI's Predicted Outputs, drafted from here)
    thinking_budget: int = -1  # SamplingParams.thinking_budget (-1: none) and its markers
    thinking_start: list[int] = []
    thinking_end: list[int] = []
    # output another instance already sent (the gateway resuming a generation whose instance was
    # lost): prefilled after the prompt, counted as output (max_tokens, the logit rules), not sent again
    resumed: list[int] = []
    return_progress: bool = False  # SamplingParams.prompt_progress: PROMPT_PROGRESS after each prefill chunk


class Tokens(msgspec.Struct, tag=True, frozen=True):
    req: int
    tokens: list[int]
    # when the request asked: per token, its log-probability, and its alternatives' ids and theirs
    logprobs: list[float] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    # the first TOKENS of a generation that asked (sent even with no token): the prompt's, its first token excluded
    prompt_logprobs: list[float] = []
    prompt_top_ids: list[list[int]] = []
    prompt_top_logprobs: list[list[float]] = []
    prompt_ranks: list[int] = []  # each prompt token's rank in its row (vLLM's prompt_logprobs show it)
    ranks: list[int] = []  # each output token's rank in its row, with its log-probability (empty from older peers)

    def output_ranks(self) -> list[int | None]:
        """Each output token's rank (None for each when the peer sent none)."""
        return self.ranks or [None] * len(self.tokens)


class PromptProgress(msgspec.Struct, tag=True, frozen=True):
    """How far a generation's prompt is prefilled, sent after each chunk of it when the
    request asked (llama.cpp's prompt_progress): ``processed`` of ``total`` positions are in,
    ``cache`` of them restored from the prefix cache, ``time_ms`` since the prefill began."""
    req: int
    total: int
    cache: int
    processed: int
    time_ms: float


class Done(msgspec.Struct, tag=True, frozen=True):
    req: int
    finish_reason: str
    stats: dict
    stop_token: int | None = None  # the EOS or stop token id that ended it (not in the output); None otherwise


class Cancel(msgspec.Struct, tag=True, frozen=True):
    req: int
