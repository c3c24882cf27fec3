"""The gateway's settings (``specctl gateway``, ``specctl up``): what it serves and how, each
checked once for the CLI, the embedded cluster and GatewayConfig with a ValueError naming the flag."""

from __future__ import annotations

from dataclasses import dataclass

from specctl.gateway.chat_template import load_chat_template
from specctl.gateway.reasoning import check_parser
from specctl.gateway.sampling_defaults import check_source
from specctl.gateway.tool_parsers import TOOL_PARSERS

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
