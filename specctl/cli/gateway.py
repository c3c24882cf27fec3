"""``specctl gateway`` (the HTTP door in front of target instances) and ``specctl up``
(draft server, N target instances and a gateway in one process, on loopback)."""

from __future__ import annotations

from typing import List, Optional

import typer
from rich.console import Console

from specctl.config import build_config
from specctl.errors import ConfigError
from specctl.cli.roles import SPEC_DEPTH_HELP, SPEC_MAX_SESSIONS_HELP

API_KEY_HELP = "require `Authorization: Bearer KEY` on /v1/* (or SPECCTL_API_KEY)"
WAITING_HELP = "generations that may wait for a free session while every target instance is full (503 past it)"
QUEUE_TIMEOUT_HELP = "seconds a generation may wait for a free session before a 503 (0: refuse at once)"
ORIGINS_HELP = ("a browser origin answered with CORS headers, e.g. http://localhost:3000 (repeat; * for any); "
                "default: none")
POLICY_HELP = ("fcfs: generations waiting for a session go first come first served; priority: by their request's "
               "priority (lower first), then arrival (vLLM's --scheduling-policy)")
SERVED_HELP = ("a name clients may give as `model` (repeat for several; answers carry the first); default: the "
               "target's name")
STORE_HELP = ("Responses API answers kept in memory for previous_response_id and GET /v1/responses/{id}: the last N "
              "(0 keeps none)")
# The serving options gateway and up share (the gateway's own, for up's embedded gateway).
RESPONSES_STORE = typer.Option(256, "--responses-store", help=STORE_HELP)
MAX_WAITING = typer.Option(1024, "--max-waiting", help=WAITING_HELP)
QUEUE_TIMEOUT = typer.Option(600.0, "--queue-timeout", help=QUEUE_TIMEOUT_HELP)
SERVED_MODEL_NAME = typer.Option([], "--served-model-name", help=SERVED_HELP)
SCHEDULING_POLICY = typer.Option("fcfs", "--scheduling-policy", help=POLICY_HELP)
ALLOWED_ORIGINS = typer.Option([], "--allowed-origins", help=ORIGINS_HELP)
LOG_REQUESTS = typer.Option(False, "--enable-log-requests",
                            help="log a line per generation request taken (id, parameters) and ended (vLLM's)")
REQUEST_ID_HEADERS = typer.Option(False, "--enable-request-id-headers",
                                  help="every answer carries X-Request-Id: the client's, else a fresh one (vLLM's)")
TOOL_CALL_PARSER = typer.Option("hermes", "--tool-call-parser",
                                help="hermes (<tool_call> blocks: Qwen2.5, Qwen3) | llama3_json (Llama 3.1-3.3's "
                                     "JSON calls) | pythonic (Llama 3.2, Llama 4: \\[name(key=value), ...]) | mistral "
                                     "(content, then \\[TOOL_CALLS] and the calls; the tag is a special token, kept "
                                     "in the text of a request with tools) | phi4_mini_json (Phi-4-mini's "
                                     "functools\\[...]) | openai (gpt-oss: messages to functions.NAME; with "
                                     "--reasoning-parser openai_gptoss) | glm45 (GLM-4.5/4.6: <tool_call> blocks of "
                                     "<arg_key>/<arg_value> pairs): how tool calls are read from the output (vLLM's)")
GENERATION_CONFIG = typer.Option("auto", "--generation-config",
                                 help="auto: what a request leaves out (temperature, top_p, top_k, min_p, "
                                      "repetition_penalty, max_tokens) takes the model's generation_config.json "
                                      "recommendation; vllm: OpenAI's defaults; or a folder with that file (vLLM's)")
CHAT_TEMPLATE = typer.Option(None, "--chat-template",
                             help="the chat template to render conversations with, a file or the template itself, "
                                  "in place of the tokenizer's (vLLM's)")
MAX_MODEL_LEN = typer.Option(None, "--max-model-len",
                             help="the longest context served (prompt and output), below the model's (vLLM's)")
AUTO_TOOL_CHOICE = typer.Option(False, "--enable-auto-tool-choice",
                                help="taken for vLLM's command lines: tool_choice auto is always served")
REASONING_PARSER = typer.Option(None, "--reasoning-parser",
                                help="qwen3 | deepseek_r1: a chat answer's <think> part as message.reasoning, apart "
                                     "from its content; openai_gptoss: gpt-oss's analysis channel as reasoning, its "
                                     "final channel as content (vLLM's)")


MAX_BODY_KB = typer.Option(16 * 1024, "--max-body-kb", help="largest request body accepted, in KiB (413 above)")


def serving_options(responses_store: int, max_waiting: int, queue_timeout: float, served_model_name: List[str],
                    scheduling_policy: str, allowed_origins: List[str], request_id_headers: bool,
                    log_requests: bool, reasoning_parser: str | None, tool_call_parser: str = "hermes",
                    generation_config: str = "auto", chat_template: str | None = None) -> dict:
    """The shared serving options, checked (gateway.config.check_serving) before any model loads,
    as GatewayConfig and ClusterConfig name them."""
    from specctl.gateway.config import check_serving

    try:
        check_serving(responses_store, tuple(served_model_name), scheduling_policy, max_waiting, queue_timeout,
                      reasoning_parser, tool_call_parser, generation_config, chat_template)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return {"responses_store": responses_store, "max_waiting": max_waiting, "queue_timeout_s": queue_timeout,
            "served_model_names": tuple(served_model_name), "scheduling_policy": scheduling_policy,
            "allowed_origins": tuple(allowed_origins), "request_id_headers": request_id_headers,
            "log_requests": log_requests, "reasoning_parser": reasoning_parser, "tool_call_parser": tool_call_parser,
            "generation_config": generation_config, "chat_template": chat_template}


def gateway(
    target: List[str] = typer.Option(..., "--target", help="target instance HOST:PORT (repeatable)"),
    drafter: List[str] = typer.Option([], "--drafter", help="draft server HOST:PORT to watch (found from targets too)"),
    port: int = typer.Option(8000, help="HTTP port (0 = any free port)"),
    host: str = typer.Option("127.0.0.1", help="address to bind (0.0.0.0 for every interface)"),
    model: Optional[str] = typer.Option(None, help="model whose tokenizer to use (default: what the targets serve)"),
    default_max_tokens: int = typer.Option(256, "--default-max-tokens", help="chat max_tokens when a request gives none"),
    max_body_kb: int = MAX_BODY_KB,
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECCTL_API_KEY", help=API_KEY_HELP),
    responses_store: int = RESPONSES_STORE,
    max_waiting: int = MAX_WAITING,
    queue_timeout: float = QUEUE_TIMEOUT,
    served_model_name: List[str] = SERVED_MODEL_NAME,
    scheduling_policy: str = SCHEDULING_POLICY,
    allowed_origins: List[str] = ALLOWED_ORIGINS,
    request_id_headers: bool = REQUEST_ID_HEADERS,
    log_requests: bool = LOG_REQUESTS,
    reasoning_parser: Optional[str] = REASONING_PARSER,
    tool_call_parser: str = TOOL_CALL_PARSER,
    auto_tool_choice: bool = AUTO_TOOL_CHOICE,
    generation_config: str = GENERATION_CONFIG,
    chat_template: Optional[str] = CHAT_TEMPLATE,
    max_model_len: Optional[int] = MAX_MODEL_LEN,
    auth_token: Optional[str] = typer.Option(None, "--auth-token", envvar="SPECCTL_AUTH_TOKEN",
                                             help="auth token of the target instances"),
    tls_ca: Optional[str] = typer.Option(None, "--tls-ca", help="CA file: talk TLS to the target instances"),
    log_level: str = typer.Option("info", "--log-level", help="debug | info | warning"),
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/responses, /v1/models), /health,
    /metrics and vLLM's /tokenize, /detokenize, /ping, /load over target instances; Anthropic's
    /v1/messages, llama.cpp's /completion, /infill, /props, /apply-template and SGLang's /generate,
    /get_model_info, /health_generate too, for their clients."""

    from specctl.engine.tokenizers import read_tokenizer, vocab_fingerprint
    from specctl.engine.families import context_limit, read_text_config
    from specctl.gateway.metrics import GatewayMetrics
    from specctl.gateway.chat_template import load_chat_template
    from specctl.gateway.harmony import serving_parsers
    from specctl.gateway.sampling_defaults import describe, sampling_defaults
    from specctl.gateway.config import GatewayConfig, served_context
    from specctl.gateway.server import Gateway
    from specctl.gateway.upstream import Upstream
    from specctl.runtime.loop import run, serve, setup_logging
    from specctl.runtime.tls import client_context
    from specctl.spec.factory import split_model_name
    from specctl.store import resolve_model

    serving = serving_options(responses_store, max_waiting, queue_timeout, served_model_name, scheduling_policy,
                              allowed_origins, request_id_headers, log_requests, reasoning_parser, tool_call_parser,
                              generation_config, chat_template)
    if max_body_kb < 1:
        raise ConfigError(f"--max-body-kb must be at least 1, got {max_body_kb}")
    setup_logging(log_level)
    console = Console(stderr=True)

    async def main() -> None:
        metrics = GatewayMetrics()
        upstream = Upstream(target, drafter, auth_token=auth_token, ssl=client_context(tls_ca), metrics=metrics,
                            max_waiting=max_waiting, queue_timeout_s=queue_timeout)
        gateway_options = {k: v for k, v in serving.items()
                           if k not in ("max_waiting", "queue_timeout_s", "generation_config", "chat_template")}
        await upstream.poll_once()
        name = model or next((t.welcome.model for t in upstream.targets if t.welcome), None)
        if name is None:
            errors = "; ".join(f"{t.address}: {t.error}" for t in upstream.targets)
            raise ConfigError(f"no target instance answered ({errors}); start them first or pass --model")
        path = resolve_model(split_model_name(name)[0], console)
        tokenizer = read_tokenizer(path)  # its own: the chat template may change below
        if chat_template is not None:
            tokenizer.chat_template = load_chat_template(chat_template)
        upstream.fingerprint = vocab_fingerprint(tokenizer)
        config = read_text_config(path)
        try:
            context = served_context(context_limit(config), max_model_len)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        parsers = serving_parsers(config.model_type, reasoning_parser, tool_call_parser)
        if parsers != (reasoning_parser, tool_call_parser):
            console.print(f"[dim]gpt-oss: harmony read as vLLM reads it (--reasoning-parser {parsers[0]} "
                          f"--tool-call-parser {parsers[1]})[/]")
        gateway_options["reasoning_parser"], gateway_options["tool_call_parser"] = parsers
        defaults = sampling_defaults(path, generation_config)
        if defaults:
            console.print(f"[dim]{describe(defaults)}[/]", soft_wrap=True)
        server = Gateway(GatewayConfig(model_name=name, context=context, host=host, port=port,
                                       default_max_tokens=default_max_tokens, max_body_bytes=max_body_kb * 1024,
                                       api_key=api_key, sampling_defaults=tuple(defaults.items()), **gateway_options),
                         tokenizer, upstream, metrics)
        await serve(server, lambda bound: console.print(
            f"gateway for [bold]{name}[/]{served_as(served_model_name)} on http://{host}:{bound}/v1 over {len(target)} target instance(s)"
            f"{' (API key required)' if api_key else ''}", soft_wrap=True))

    run(main())


def served_as(names: List[str]) -> str:
    return f" as {', '.join(names)}" if names else ""


def cluster_config(profile, draft, target, mode, dtype, draft_quant, threads, drafters=None, max_sessions=None,
                   spec_max_sessions=None, spec_depth_by_load=None):
    if drafters is not None and mode not in (None, "multi"):
        raise ConfigError("--drafters routes among several drafters: leave --mode out")
    config = build_config(profile, draft=draft, target=target, mode="multi" if drafters is not None else mode,
                          drafters=drafters, dtype=dtype, draft_quant=draft_quant, threads=threads,
                          max_sessions=max_sessions, spec_max_sessions=spec_max_sessions,
                          spec_depth_by_load=spec_depth_by_load)
    if config.mode not in ("chain", "tree", "multi"):
        raise ConfigError("the embedded cluster runs a draft server: --mode must be chain or tree")
    return config


def up(
    draft: Optional[str] = typer.Option(None, help="draft model (default: qwen2.5-coder-0.5b)"),
    target: Optional[str] = typer.Option(None, help="target model (default: qwen2.5-coder-1.5b)"),
    targets: int = typer.Option(1, help="number of target instances"),
    stages: int = typer.Option(1, help="pipeline stages per target instance (the target split by layers, each "
                               "stage a server on loopback)"),
    port: int = typer.Option(8000, help="gateway HTTP port (0 = any free port, printed at start)"),
    responses_store: int = RESPONSES_STORE,
    max_waiting: int = MAX_WAITING,
    queue_timeout: float = QUEUE_TIMEOUT,
    served_model_name: List[str] = SERVED_MODEL_NAME,
    scheduling_policy: str = SCHEDULING_POLICY,
    allowed_origins: List[str] = ALLOWED_ORIGINS,
    request_id_headers: bool = REQUEST_ID_HEADERS,
    log_requests: bool = LOG_REQUESTS,
    reasoning_parser: Optional[str] = REASONING_PARSER,
    tool_call_parser: str = TOOL_CALL_PARSER,
    auto_tool_choice: bool = AUTO_TOOL_CHOICE,
    generation_config: str = GENERATION_CONFIG,
    chat_template: Optional[str] = CHAT_TEMPLATE,
    max_model_len: Optional[int] = MAX_MODEL_LEN,
    max_body_kb: int = MAX_BODY_KB,
    max_sessions: Optional[int] = typer.Option(None, "--max-sessions", help="most concurrent sessions a target "
                                               "instance holds (vLLM's --max-num-seqs; the profile's by default); "
                                               "past them requests wait (--max-waiting)"),
    spec_max_sessions: Optional[int] = typer.Option(None, "--spec-max-sessions", help=SPEC_MAX_SESSIONS_HELP),
    spec_depth_by_load: Optional[str] = typer.Option(None, "--spec-depth-by-load", help=SPEC_DEPTH_HELP),
    mode: Optional[str] = typer.Option(None, help="chain | tree"),
    drafters: Optional[str] = typer.Option(None, help="several drafters instead of --draft: comma-separated model "
                                           "names, NAME@N, ngram and suffix; a draft server per model, every target routes "
                                           "among them and fuses their chains (CoSine)"),
    dtype: Optional[str] = typer.Option(None, help="fp32 | bf16 | fp16"),
    draft_quant: Optional[str] = typer.Option(None, "--draft-quant", help="none | int8"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads"),
    profile: Optional[str] = typer.Option(None, help="hardware profile"),
    log_level: str = typer.Option("warning", "--log-level", help="debug | info | warning"),
) -> None:
    """Start a draft server (or one per --drafters model), N target instances (each split over --stages pipeline stages) and a
    gateway on loopback; Ctrl-C stops them all."""
    from specctl.cluster.embedded import ClusterConfig, EmbeddedCluster
    from specctl.runtime.compute import ComputeThread
    from specctl.runtime.loop import run_with_compute, setup_logging, wait_for_shutdown
    from specctl.spec.factory import apply_threads

    config = cluster_config(profile, draft, target, mode, dtype, draft_quant, threads, drafters, max_sessions,
                            spec_max_sessions, spec_depth_by_load)
    try:
        plan = ClusterConfig(targets=targets, gateway_port=port, stages=stages, max_model_len=max_model_len,
                             max_body_bytes=max_body_kb * 1024,
                             **serving_options(responses_store, max_waiting, queue_timeout, served_model_name,
                                               scheduling_policy, allowed_origins, request_id_headers,
                                               log_requests, reasoning_parser, tool_call_parser,
                                               generation_config, chat_template))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    setup_logging(log_level)
    apply_threads(config)
    console = Console(stderr=True)

    async def main(compute: ComputeThread) -> None:
        cluster = EmbeddedCluster(config, plan, console, compute=compute)
        try:
            urls = await cluster.start()
            drafting = ", ".join(config.drafter_names) if config.mode == "multi" else config.draft
            console.print(f"[bold]specctl up[/]: {drafting} drafting for {targets} x {config.target} "
                          f"({config.mode}, d={config.depth}, {config.dtype})", soft_wrap=True)
            console.print(f"  gateway  {urls['gateway']}/v1{served_as(served_model_name)}   (metrics "
                          f"{urls['gateway']}/metrics)", soft_wrap=True)
            for address in urls["drafts"]:
                console.print(f"  draft    {address}", soft_wrap=True)
            for i, address in enumerate(urls["targets"]):
                more = f"   (stages 2..{stages}: {', '.join(urls['stages'][i])})" if stages > 1 else ""
                console.print(f"  target   {address}{more}", soft_wrap=True)
            console.print(f"  try: specctl chat --gateway {urls['gateway']}   |   specctl monitor --gateway "
                          f"{urls['gateway']}   |   Ctrl-C to stop", soft_wrap=True)
            await wait_for_shutdown()
        finally:
            await cluster.close()
            console.print("stopped: every role closed, ports freed")

    run_with_compute(main, ComputeThread("cpu-compute", max_batch=config.max_batch, spawn=False))
