"""The OpenAI request bodies the gateway accepts, and their validation (gateway.translate puts
a valid one in the engine's terms). Anything wrong becomes an ApiError with the HTTP status
and the OpenAI error body clients expect.

Choices where OpenAI and the servers differ (written down, as users will ask):
- temperature defaults to 1.0 and top_p to 1.0 (OpenAI); top_k is accepted as vLLM
  does (0 or -1 = off); ``seed`` makes sampling reproducible.
- max_tokens defaults to 16 for completions (OpenAI) and to the gateway's
  ``default_max_tokens`` for chat, capped by what the context has left.
- logprobs: completions ``logprobs: n``, chat ``logprobs: true`` + ``top_logprobs: n`` (n <= 20):
  the target's raw log-probabilities (before the logit rules, temperature, top-k, top-p,
  as vLLM reports them) of every completion token counted in usage, a stop string's last
  batch included;
  a token's text is its own decoding (a piece of a multi-byte character shows as U+FFFD);
  vLLM's return_tokens_as_token_ids names each "token_id:<id>" instead (chat's bytes and
  completions' text_offset stay the text's, where vLLM counts the names' lengths).
- vLLM's skip_special_tokens (default true) false keeps special tokens' text in the output.
- n choices per prompt and batched prompts (a list of strings or of token-id lists) run as
  that many generations at once (choice index = prompt index * n + j; with a seed, choice j
  samples with seed + j, as vLLM does); usage counts each prompt once. Generations past the
  instances' sessions wait for a free one (gateway.waiting), so a batch larger than they hold
  runs in turns, as vLLM queues one.
- echo (completions) puts the prompt before each choice's text (as given, or decoded from
  its token ids); with logprobs its tokens are listed first, the first with null (nothing
  precedes it), the others with the target's log-probabilities from a pass of their own over
  the prompt (the generation's prefill is untouched: the output stays the target's own).
  max_tokens 0 with echo is the prompt alone (OpenAI's legacy API, vLLM; lm-eval scores this way):
  the target generates one token, as vLLM does, left out of the answer (finish "length", 0 tokens).
- vLLM's prompt_logprobs k (completions and chat, 0-20) lists each prompt token's log-probability,
  rank and k likeliest alternatives in vLLM's shape ({token id: {logprob, rank, decoded_token}},
  null for the first token) from that same pass: per choice for completions, once beside the
  choices for chat. Not with stream, as vLLM refuses it there.
- logit_bias, presence_penalty and frequency_penalty (OpenAI's), and vLLM's
  repetition_penalty, min_tokens, min_p and bad_words are part of the target's distribution, applied by
  verification (spec.logit_rules, spec.sampling), greedy included, as vLLM applies them.
- chat tools are rendered by the model's chat template and the output parsed for calls
  (gateway.tools: vLLM's Hermes parser, and a ```json call block as llama.cpp reads one);
  tool_choice "none" renders none; "required" or a named function forces a call by structured
  output, as vLLM forces one; parallel_tool_calls false keeps the first call ("required": one).
- vLLM's chat-template fields: add_generation_prompt (default true), continue_final_message
  (the last message left open for the model to continue; not with add_generation_prompt) and
  chat_template_kwargs (variables for the template, e.g. enable_thinking; not the names the
  gateway sets itself). /tokenize takes them too.
- OpenAI's reasoning_effort (none, minimal, low, medium, high, xhigh) is the template's
  ``reasoning_effort`` variable, as vLLM passes it (gpt-oss's template reads it); ``none`` also
  sets ``enable_thinking`` false, which Qwen3-style templates read, unless chat_template_kwargs
  sets it. The Responses API's reasoning.effort is the same.
- with ``--reasoning-parser`` a chat answer's thinking is its message's ``reasoning`` (and
  ``reasoning_content``), apart from its content (gateway.reasoning); vLLM's include_reasoning
  false leaves it out, and its thinking_token_budget ends a thought after that many tokens
  (spec.thinking_budget; qwen3 and deepseek_r1 parsers).
- structured output (response_format, vLLM's guided_* and structured_outputs; gateway.structured)
  constrains the target's distribution to the grammar (spec.structured: llguidance, as vLLM's
  guidance backend; JSON's whitespace bounded, its objects closed); verification applies it,
  so every mode stays the target's own output under it. One constraint a request; ignore_eos cannot go with one.
- a completion's suffix asks for the text between the prompt and it (fill in the middle,
  engine.fim): the prompt is built in the model's FIM tokens and their end tokens stop it; a
  model without FIM tokens is a 400, as are echo and truncate_prompt_tokens with a suffix.
- best_of other than n, legacy functions, vLLM's use_beam_search and prompt_embeds are a 400
  rather than silently ignored: they would change what the caller gets.
- vLLM's stop_token_ids (at most MAX_STOP_TOKEN_IDS) end the generation as EOS does: the
  stop token is not part of the output (vLLM keeps a non-special one in its text). A stop
  string is not part of the text either unless vLLM's include_stop_str_in_output asks.
  SGLang's stop_regex (at most 4 patterns) ends the text where a pattern first matches, the
  match kept (SGLang trims a stop string, not a pattern's match; engine.stop_regex).
- vLLM's return_token_ids adds the prompt's ids (a completion choice's prompt_token_ids; chat's
  beside the choices) and each choice's token_ids: every token it generated, a stop string's
  last batch and the EOS or stop token that ended it included (as vLLM's, whose text leaves
  them out); streamed, the prompt's in a choice's (chat: the answer's) first chunk and each
  chunk's new tokens. Left out unless asked (vLLM sends them as null).
- vLLM's cache_salt keeps a request's prefix-cache entries apart: its KV is reused only by
  requests of the same salt (target and draft), so tenants who do not share a salt cannot learn
  from a faster first token that another sent the same text. An empty salt is a 400, as in vLLM.
- OpenAI's prediction (Predicted Outputs, on chat and, as an extension, completions) is text
  the answer is expected to resemble: the target instance drafts from it where the output
  follows it (spec.prediction), so the answer is still the target's own and only comes
  faster; usage's completion_tokens_details counts the prediction's tokens found in the answer
  (their longest common subsequence) and the rest, as OpenAI defines them. Text parts only;
  longer than the context is a 400.
- vLLM's truncate_prompt_tokens k keeps each prompt's last k tokens (-1: as many as the
  context holds); usage counts what is kept, and echo gives back that.
- llama.cpp's return_progress (streamed requests; ignored otherwise, as llama.cpp does) sends,
  after each chunk of a prompt the target prefills, a chunk with an empty delta and
  ``prompt_progress``: total, cache (restored from the prefix cache), processed (in the cache
  now, the restored included) and time_ms (since its prefill began) — the last with processed
  equal to total, before the first token. A SpecPipe target sends none.
- Fields neither served nor refused (OpenAI's store, metadata, service_tier, ...) are
  ignored, as vLLM ignores them, with one warning a field name in the gateway's log."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from specctl.errors import SpecctlError

# vLLM, llama.cpp and SGLang take any number of stop strings; these bounds keep each token's
# check of them (engine.text, on the gateway's event loop) short whatever a request sends.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096  # every stop string's characters together
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 128  # generations one request may ask for (n times its prompts)


class ApiError(SpecctlError):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.retry_after = status, type, param, code, retry_after

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class ResponseFormat(msgspec.Struct):
    type: str = "text"
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict"}: the schema is what counts


class ContentPart(msgspec.Struct):
    type: str
    text: str = ""


class Prediction(msgspec.Struct, kw_only=True):
    """OpenAI's Predicted Outputs: ``{"type": "content", "content": text or text parts}``."""
    type: str
    content: str | list[ContentPart]


class CalledFunction(msgspec.Struct):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(msgspec.Struct):
    function: CalledFunction
    id: str | None = None
    type: str = "function"


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's answer


class RequestFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # llama.cpp's extension: a stream's chunks say how far the prompt is read before the first token
    return_progress: bool = False
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    ignore_eos: bool = False  # vLLM's extension, handy for benchmarks
    user: str | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension
    stop_regex: str | list[str] | None = None  # SGLang's extension: the text ends with a pattern's first match
    include_stop_str_in_output: bool = False  # vLLM's extension: the stop string that ended the text ends it
    truncate_prompt_tokens: int | None = None  # vLLM's extension: keep the prompt's last k tokens (-1: the context)
    priority: int = 0  # vLLM's extension: lower waits less for a session (--scheduling-policy priority)
    prompt_logprobs: int | None = None  # vLLM's extension: the prompt's tokens' log-probabilities, k alternatives
    request_id: str | None = None  # vLLM's extension: the answer's id (an X-Request-Id header wins; gateway.request_id)
    skip_special_tokens: bool = True  # vLLM's extension: False keeps special tokens in the text
    return_tokens_as_token_ids: bool = False  # vLLM's extension: logprobs name tokens "token_id:<id>"
    return_token_ids: bool = False  # vLLM's extension: the prompt's and each choice's token ids beside the text
    cache_salt: str | None = None  # vLLM's extension: the prefix cache reuses KV only within the same salt
    prediction: Prediction | None = None  # OpenAI's Predicted Outputs: drafted from (spec.prediction)
    # vLLM's: a thought ended (its </think> forced) after this many tokens (spec.thinking_budget);
    # needs --reasoning-parser qwen3 or deepseek_r1. Anthropic's thinking.budget_tokens comes here.
    thinking_token_budget: int | None = None
    # vLLM's extensions that reshape or constrain sampling (gateway.structured)
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    # llama.cpp's, an extension: the penalties over the text's last n tokens, the prompt's included
    # (-1: all of it; 0: no penalties); left out, vLLM's (repetition over prompt and output,
    # presence and frequency over the output)
    repeat_last_n: int | None = None
    # llama.cpp's, an extension: which samplers run, in which order (gateway.llama_samplers); left
    # out, vLLM's (temperature first)
    samplers: list[str] | str | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's extension: only these tokens may come
    # vLLM's extensions refused when asked (refuse_unsupported): another search, other inputs
    use_beam_search: bool = False
    prompt_embeds: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(RequestFields, kw_only=True):
    endpoint: ClassVar[str] = "/v1/completions"  # named in the log of fields it ignores
    prompt: str | list[int | str | list[int]]  # text, token ids, or a batch of either
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(RequestFields, kw_only=True):
    endpoint: ClassVar[str] = "/v1/chat/completions"  # named in the log of fields it ignores
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    parallel_tool_calls: bool = True  # False: the first call only (OpenAI's; as vLLM drops the others)
    # vLLM's extensions for the chat template (gateway.translate.chat_template_options)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # vLLM's: false leaves the thinking out (with --reasoning-parser)
    reasoning_effort: str | None = None  # OpenAI's: the template's reasoning_effort ("none": no thinking)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: a completion prompt or chat messages (as the endpoints encode them)."""
    endpoint: ClassVar[str] = "/tokenize"
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False  # vLLM's: each id's token as the vocabulary writes it, too
    # llama.cpp's: ``content`` (answered in its shape, {"tokens"}), BOS only with add_special, ids with their pieces
    content: str | None = None
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    endpoint: ClassVar[str] = "/detokenize"
    model: str | None = None
    tokens: list[int]
