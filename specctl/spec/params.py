"""A request's sampling parameters, checked where they are made (InvalidSamplingParams), and
their limits. No torch here: clients, the gateway's front and the monitor build and send
them without it (spec.sampling turns them into probabilities)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specctl.errors import InvalidSamplingParams

MAX_LOGPROBS = 20  # alternatives per token, as vLLM and OpenAI allow
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_BAD_WORDS = 64  # token sequences one request may bar (vLLM's bad_words, each with and without a space)
MAX_BAD_WORD_TOKENS = 32
MAX_PENALTY_LAST_N = 1 << 20  # tokens: past any context served
MAX_ALLOWED_TOKENS = 1 << 18  # past any vocabulary served
MAX_CACHE_SALT = 1024  # characters (vLLM suggests 43: 256 random bits in base64)
MAX_PREDICTION_TOKENS = 1 << 17  # past any context served
# The order the distribution's samplers apply in: vLLM's and transformers' (temperature first);
# llama.cpp applies temperature last (SamplingParams.sampler_order)
SAMPLER_ORDER = ("temperature", "top_k", "top_p", "min_p")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 128
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n: each token's log-probability and its n likeliest alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (the first has none: nothing precedes it)
    presence_penalty: float = 0.0  # OpenAI's, over the output's tokens (spec.logit_rules)
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # transformers'/vLLM's, over prompt and output; 1 = off
    # the penalties' window: 0 = vLLM's (repetition_penalty over prompt and output, presence and
    # frequency over the output); n > 0 = llama.cpp's repeat_last_n (all three over the text's
    # last n tokens, the prompt's included)
    penalty_last_n: int = 0
    min_p: float = 0.0  # drop tokens below min_p times the likeliest one's probability (after top-p); 0 = off
    min_tokens: int = 0  # the stop tokens (EOS, stop_token_ids) are barred until this many are out
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit), OpenAI's -100..100
    # vLLM's bad_words as token sequences: a sequence's last token is barred where the output
    # so far ends with the rest of it (spec.logit_rules)
    bad_words: tuple[tuple[int, ...], ...] = ()
    # (kind, spec): the output constrained to a grammar (spec.structured: "json" + a JSON schema,
    # "regex", "choice" + a JSON list of strings, "grammar" + Lark/GBNF); None = unconstrained
    structured: tuple[str, str] | None = None
    # vLLM's allowed_token_ids: only these tokens may come (spec.logit_rules); () = any
    allowed_token_ids: tuple[int, ...] = ()
    # the order of temperature, top_k, top_p and min_p (each once); () = SAMPLER_ORDER. Where top_p
    # or min_p comes before temperature it reads the unscaled distribution (llama.cpp's samplers)
    sampler_order: tuple[str, ...] = ()
    # vLLM's cache_salt: the prefix cache reuses KV only among requests of the same salt (its
    # namespace, KVCache.salt), target and draft; "" = the shared namespace
    cache_salt: str = ""
    # OpenAI's Predicted Outputs: token ids the output is expected to resemble; drafted from where
    # the target runs (spec.prediction); () = none
    prediction: tuple[int, ...] = ()
    # vLLM's thinking_token_budget: a thought is ended (its end marker forced) after this many
    # tokens (spec.thinking_budget); None = unbounded. The markers: (<think>'s ids, </think>'s ids)
    thinking_budget: int | None = None
    thinking_markers: tuple[tuple[int, ...], tuple[int, ...]] = ()
    # llama.cpp's return_progress: the target reports the prompt's prefill as it goes, chunk by
    # chunk (net PromptProgress), before the first token; it changes nothing of the output
    prompt_progress: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            raise InvalidSamplingParams(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise InvalidSamplingParams(f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise InvalidSamplingParams(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and -2**63 <= self.seed < 2**63):
            # a 64-bit integer, as vLLM takes it (torch's generators take a negative one as its two's complement)
            raise InvalidSamplingParams(f"seed must be an integer from {-2**63} to {2**63 - 1}, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2.0 <= value <= 2.0):
                raise InvalidSamplingParams(f"{name} must be between -2 and 2, got {value!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and 0.0 < self.repetition_penalty <= 100.0):
            raise InvalidSamplingParams(f"repetition_penalty must be in (0, 100] (1 = off), got "
                                        f"{self.repetition_penalty!r}")
        if not (isinstance(self.penalty_last_n, int) and 0 <= self.penalty_last_n <= MAX_PENALTY_LAST_N):
            raise InvalidSamplingParams(f"penalty_last_n must be an integer between 0 (vLLM's penalties) and "
                                        f"{MAX_PENALTY_LAST_N}, got {self.penalty_last_n!r}")
        if not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise InvalidSamplingParams(f"min_p must be between 0 and 1, got {self.min_p!r}")
        if not (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens):
            raise InvalidSamplingParams(f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got "
                                        f"{self.min_tokens!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidSamplingParams(f"logit_bias may bias at most {MAX_LOGIT_BIAS} tokens, got "
                                        f"{len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if not (isinstance(token, int) and token >= 0 and isinstance(bias, (int, float)) and -100 <= bias <= 100):
                raise InvalidSamplingParams(f"logit_bias maps token ids (>= 0) to values between -100 and 100, got "
                                            f"{token!r}: {bias!r}")
        if len(self.bad_words) > MAX_BAD_WORDS or not all(
                isinstance(word, tuple) and 1 <= len(word) <= MAX_BAD_WORD_TOKENS
                and all(isinstance(t, int) and t >= 0 for t in word) for word in self.bad_words):
            raise InvalidSamplingParams(f"bad_words are at most {MAX_BAD_WORDS} token sequences of 1 to "
                                        f"{MAX_BAD_WORD_TOKENS} token ids (>= 0)")
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKENS or not all(
                isinstance(t, int) and t >= 0 for t in self.allowed_token_ids):
            raise InvalidSamplingParams(f"allowed_token_ids are at most {MAX_ALLOWED_TOKENS} token ids (>= 0)")
        if len(self.prediction) > MAX_PREDICTION_TOKENS or not all(
                isinstance(t, int) and t >= 0 for t in self.prediction):
            raise InvalidSamplingParams(f"prediction is at most {MAX_PREDICTION_TOKENS} token ids (>= 0)")
        if self.thinking_budget is not None:
            from specctl.spec.thinking_budget import MAX_MARKER_TOKENS

            if not (isinstance(self.thinking_budget, int) and 0 <= self.thinking_budget < 2**31):
                raise InvalidSamplingParams(f"thinking_budget must be a non-negative integer, got "
                                            f"{self.thinking_budget!r}")
            if len(self.thinking_markers) != 2 or not all(
                    isinstance(marker, tuple) and 1 <= len(marker) <= MAX_MARKER_TOKENS
                    and all(isinstance(t, int) and t >= 0 for t in marker) for marker in self.thinking_markers):
                raise InvalidSamplingParams(f"thinking_budget needs the thinking's start and end markers, each 1 to "
                                            f"{MAX_MARKER_TOKENS} token ids (>= 0)")
        if not isinstance(self.prompt_progress, bool):
            raise InvalidSamplingParams(f"prompt_progress must be true or false, got {self.prompt_progress!r}")
        if not (isinstance(self.cache_salt, str) and len(self.cache_salt) <= MAX_CACHE_SALT):
            raise InvalidSamplingParams(f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters")
        if self.sampler_order and sorted(self.sampler_order) != sorted(SAMPLER_ORDER):
            raise InvalidSamplingParams(f"sampler_order names {', '.join(SAMPLER_ORDER)} once each, in the order they "
                                        f"apply, got {list(self.sampler_order)!r:.120}")
        if self.structured is not None:
            from specctl.spec.structured import KINDS, MAX_SPEC_CHARS

            kind, spec = self.structured if len(self.structured) == 2 else (None, None)
            if kind not in KINDS or not isinstance(spec, str) or not spec:
                raise InvalidSamplingParams(f"structured output is a kind ({', '.join(KINDS)}) and its text, got "
                                            f"{self.structured!r:.80}")
            if len(spec) > MAX_SPEC_CHARS:
                raise InvalidSamplingParams(f"structured output's {kind} may have at most {MAX_SPEC_CHARS} "
                                            f"characters, got {len(spec)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS):
                raise InvalidSamplingParams(f"{name} must be between 0 and {MAX_LOGPROBS} (the alternatives listed "
                                            f"beside each token), got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def repeatable(self) -> bool:
        """Seeded and sampled: the seed asks for the same text each time (a greedy text repeats
        anyway). Its draft then computes every bit as a cold start alone would
        (spec.draft_state.DraftState.reproducible)."""
        return self.seed is not None and not self.greedy

    @property
    def adjusts_logits(self) -> bool:
        """Whether the target's logits are changed before sampling (spec.logit_rules, spec.structured)."""
        return (bool(self.presence_penalty or self.frequency_penalty or self.min_tokens or self.logit_bias
                     or self.bad_words or self.allowed_token_ids)
                or self.repetition_penalty != 1.0 or self.structured is not None or self.thinking_budget is not None)
