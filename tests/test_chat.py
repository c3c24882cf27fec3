"""``specctl chat``: the REPL against a live gateway (in-process, tiny models), Ctrl-C
driven through tmux, and the no-argument embedded cluster with the default pair (slow)."""

import contextlib
import json
import shutil
import subprocess
import sys
import time

import openai
import pytest
from aiohttp import web
from rich.console import Console

from specctl.chat import transcript
from specctl.chat.commands import HELP, ChatState, Quit, command, retry_point
from specctl.chat.repl import greeting, multiline, repl, stat_line, stream_reply
from specctl.cluster.embedded import ClusterConfig, ClusterThread
from specctl.config import build_config

from conftest import needs_qwen, poll_until

needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


@pytest.fixture(scope="module")
def gateway(tiny_dir):
    config = build_config(None, target=str(tiny_dir["llama"]), draft=f"{tiny_dir['llama']}@2", mode="chain", depth=3,
                          dtype="fp32", draft_quant="none")
    cluster = ClusterThread(config, ClusterConfig(targets=1, gateway_port=0))
    urls = cluster.start()
    yield urls["gateway"]
    cluster.stop()


def test_commands_change_the_state():
    state = ChatState()
    state.messages.append({"role": "user", "content": "hi"})
    assert command("/temp 0.7", state) == "temperature 0.7" and state.temperature == 0.7
    assert command("/temp hot", state).startswith("usage: /temp T")
    assert command("/temp -1", state) == "temperature must be between 0 and 100"
    assert command("/reset", state) == "conversation cleared" and state.messages == []
    state.messages.append({"role": "user", "content": "hi"})
    assert command("/clear", state) == "conversation cleared" and state.messages == []  # Ollama's name
    assert command("/?", state) == command("/help", state) == HELP
    assert command("/frobnicate", state).startswith("unknown command /frobnicate")
    assert command("/max 64", state) == "at most 64 tokens a reply" and state.max_tokens == 64
    assert command("/max lots", state).startswith("usage: /max N (now 64)")
    assert command("/max 0", state) == "/max must be at least 1" and state.max_tokens == 64
    state.messages.append({"role": "user", "content": "hi"})
    assert command("/system  Answer in French. ", state) == "system prompt: Answer in French."
    assert state.request_messages() == [{"role": "system", "content": "Answer in French."},
                                        {"role": "user", "content": "hi"}]
    command("/reset", state)
    assert state.request_messages() == [{"role": "system", "content": "Answer in French."}]  # kept by /reset
    assert command("/system", state) == "no system prompt" and state.request_messages() == []
    for name in ("/quit", "/exit", "/q", "/bye"):
        with pytest.raises(Quit):
            command(name, state)


def test_effort_and_predict_set_what_the_next_request_sends(tmp_path):
    state = ChatState(max_tokens=8)
    state.messages.append({"role": "user", "content": "hi"})
    assert "reasoning_effort" not in state.request_body() and "prediction" not in state.request_body()
    assert command("/effort low", state) == "reasoning effort low" and state.request_body()["reasoning_effort"] == "low"
    assert command("/effort lots", state) == "usage: /effort none|minimal|low|medium|high|xhigh|default (now low)"
    assert command("/effort default", state) == "reasoning effort: the model's default"
    assert state.reasoning_effort is None and "reasoning_effort" not in state.request_body()
    source = tmp_path / "cache.py"
    source.write_text("def get(key):\n    return CACHE[key]\n")
    assert command(f"/predict {source}", state) == \
        f"the next reply is predicted from {source} (36 characters; /predict alone drops it)"
    assert state.request_body()["prediction"] == {"type": "content", "content": source.read_text()}
    assert state.request_body()["messages"] == [{"role": "user", "content": "hi"}]
    assert command("/predict", state) == "prediction dropped" and "prediction" not in state.request_body()
    assert command("/predict", state) == "usage: /predict FILE (the next reply is expected to resemble it)"
    assert command(f"/predict {tmp_path / 'gone.py'}", state) == \
        f"cannot read {tmp_path / 'gone.py'}: No such file or directory" and state.prediction is None
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\xff\xfe\x00")
    assert command(f"/predict {binary}", state).startswith(f"cannot read {binary}: 'utf-8' codec can't decode")


def test_a_message_of_several_lines_goes_between_triple_quotes():
    def typed(first, *rest):
        more = iter(rest)
        return multiline(first, lambda: next(more))

    assert typed('"""', "def f(x):", "    return x", '"""') == "def f(x):\n    return x"
    assert typed('  """one line"""') == "one line"
    assert typed('"""first', 'last"""') == "first\nlast"
    with pytest.raises(StopIteration):  # input that ends inside the message: the reader's end
        typed('"""', "unfinished")


def test_a_block_is_one_message_even_one_that_begins_with_a_slash(gateway):
    console = Console(record=True, width=200, file=open("/dev/null", "w"))
    state = ChatState(max_tokens=4)
    lines = iter(['"""', "/reset is a command", "not here", '"""', "/quit"])
    repl(gateway, console, state, read=lambda: next(lines))
    assert state.messages[0] == {"role": "user", "content": "/reset is a command\nnot here"}
    assert [m["role"] for m in state.messages] == ["user", "assistant"]


def test_the_stat_line_counts_a_predictions_tokens_only_when_one_was_sent():
    usage = {"completion_tokens": 11}
    assert stat_line(usage, {}, None, None) == "11 tokens, - tok/s, mean accepted length 0.00, acceptance 0%"
    usage["completion_tokens_details"] = {"accepted_prediction_tokens": 9, "rejected_prediction_tokens": 2}
    assert stat_line(usage, {}, None, None).endswith("acceptance 0%, prediction 9 accepted 2 rejected")


def test_undo_retry_save_and_load_keep_the_conversation_as_it_should_be(tmp_path):
    state = ChatState(temperature=0.5, max_tokens=32, system="Be terse.")
    exchange = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "more"}, {"role": "assistant", "content": "sure"}]
    state.messages.extend(exchange)
    path = tmp_path / "talk.json"
    assert command(f"/save {path}", state) == f"saved 4 messages to {path}"
    assert command("/undo", state) == "dropped the last exchange (2 messages left)" and state.messages == exchange[:2]
    state.messages.append({"role": "user", "content": "unanswered"})  # a reply that failed or was stopped empty
    assert command("/undo", state) == "dropped the last exchange (2 messages left)" and state.messages == exchange[:2]
    assert retry_point(state) and state.messages == exchange[:1]  # the last reply goes; the question is asked again
    assert retry_point(state) and state.messages == exchange[:1]
    assert command("/undo", state) == "dropped the last exchange (0 messages left)"
    assert command("/undo", state) == "nothing to undo" and not retry_point(state)
    fresh = ChatState()
    assert command(f"/load {path}", fresh) == f"loaded 4 messages from {path}"
    assert (fresh.messages, fresh.system, fresh.temperature, fresh.max_tokens) == (exchange, "Be terse.", 0.5, 32)
    assert fresh.reasoning_effort is None
    effortful = tmp_path / "effortful.json"
    transcript.save(effortful, ChatState(messages=list(exchange), reasoning_effort="high"))
    assert command(f"/load {effortful}", fresh).startswith("loaded 4") and fresh.reasoning_effort == "high"
    assert command("/save", fresh) == "usage: /save FILE (the conversation as JSON)"
    assert command(f"/load {tmp_path / 'missing.json'}", fresh) == \
        f"cannot load {tmp_path / 'missing.json'}: No such file or directory"
    for text, reason in (("[1, 2]", 'not a saved conversation: no "messages" list'),
                         ('{"messages": [{"role": "system", "content": "x"}]}',
                          'message 0 must be {"role": "user" or "assistant", "content": text}'),
                         ('{"messages": [], "temperature": "hot"}', '"temperature" must be a number between 0 and 100'),
                         ('{"messages": [], "max_tokens": 0}', '"max_tokens" must be a whole number of at least 1'),
                         ('{"messages": [], "reasoning_effort": "max"}',
                          '"reasoning_effort" must be null or one of none, minimal, low, medium, high, xhigh'),
                         ("{", "not JSON: ")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        answer = command(f"/load {bad}", fresh)
        assert answer.startswith(f"cannot load {bad}: {reason}"), answer
        assert fresh.messages == exchange  # a bad file changes nothing


def test_repl_streams_the_targets_greedy_reply_and_keeps_the_conversation(gateway):
    reference = openai.OpenAI(base_url=gateway + "/v1", api_key="x").chat.completions.create(
        model="", messages=[{"role": "user", "content": "hello"}], max_tokens=12, temperature=0).choices[0].message.content
    console = Console(record=True, width=200, file=open("/dev/null", "w"))
    state = ChatState(max_tokens=12)
    lines = iter(["hello", "/temp 0.5", "and again", "/system Be terse.", "/temp 0", "/max 6", "third", "/quit",
                  "never read"])
    repl(gateway, console, state, read=lambda: next(lines))
    out = console.export_text()
    assert f"assistant> {reference}" in out.replace("\n", "")
    assert out.count(" tok/s, mean accepted length") == 3 and "tok/s, mean accepted length" in out
    assert [m["role"] for m in state.messages] == ["user", "assistant"] * 3
    assert state.messages[1]["content"] == reference
    third = openai.OpenAI(base_url=gateway + "/v1", api_key="x").chat.completions.create(  # the system prompt first
        model="", messages=[{"role": "system", "content": "Be terse."}, *state.messages[:4],
                            {"role": "user", "content": "third"}], max_tokens=6, temperature=0).choices[0].message
    assert state.messages[5]["content"] == third.content
    assert next(lines) == "never read"


def test_a_predicted_reply_is_the_greedy_one_counts_its_tokens_and_the_prediction_is_used_once(gateway, tmp_path):
    reference = openai.OpenAI(base_url=gateway + "/v1", api_key="x").chat.completions.create(
        model="", messages=[{"role": "user", "content": "hello"}], max_tokens=16, temperature=0).choices[0].message.content
    predicted = tmp_path / "reply.txt"
    predicted.write_text(reference)
    console = Console(record=True, width=200, file=open("/dev/null", "w"))
    state = ChatState(max_tokens=16)
    lines = iter(["/effort low", f"/predict {predicted}", "hello", "/undo", "hello", "/quit"])
    repl(gateway, console, state, read=lambda: next(lines))
    out = console.export_text()
    assert out.replace("\n", "").count(f"assistant> {reference}".replace("\n", "")) == 2
    assert state.messages == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": reference}]
    assert out.count(", prediction ") == 1 and ", prediction 0 accepted" not in out  # the second reply had none
    assert state.prediction is None and state.reasoning_effort == "low"


def test_retry_answers_the_last_message_again_and_a_loaded_conversation_goes_on(gateway, tmp_path):
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="x")
    console = Console(record=True, width=200, file=open("/dev/null", "w"))
    state = ChatState(max_tokens=8)
    path = tmp_path / "talk.json"
    lines = iter(["hello", "/temp 1", "/retry", "/temp 0", "/retry", f"/save {path}", "/undo", "/quit"])
    repl(gateway, console, state, read=lambda: next(lines))
    greedy = client.chat.completions.create(model="", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
                                            temperature=0).choices[0].message.content
    assert state.messages == [] and console.export_text().count("tok/s, mean accepted length") == 3
    loaded = ChatState()
    lines = iter([f"/load {path}", "again", "/quit"])
    repl(gateway, console, loaded, read=lambda: next(lines))
    assert loaded.messages[:2] == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": greedy}]
    again = client.chat.completions.create(model="", messages=[*loaded.messages[:2], {"role": "user", "content": "again"}],
                                           max_tokens=8, temperature=0).choices[0].message.content
    assert loaded.messages[2:] == [{"role": "user", "content": "again"}, {"role": "assistant", "content": again}]


def test_chat_load_goes_on_with_a_saved_conversation_and_flags_win_over_its_settings(tmp_path):
    saved, out = tmp_path / "talk.json", tmp_path / "out.json"
    conversation = {"system": "Be terse.", "temperature": 0.5, "max_tokens": 32,
                    "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    saved.write_text(json.dumps(conversation))

    def chat(*flags, lines=""):
        return subprocess.run([sys.executable, "-m", "specctl", "chat", "--gateway", "http://127.0.0.1:9", *flags],
                              input=lines, capture_output=True, text=True, timeout=120)

    run = chat("--load", str(saved), "--temperature", "0.7", "--reasoning-effort", "low", lines=f"/save {out}\n/quit\n")
    assert run.returncode == 0, run.stderr
    assert "2 messages loaded from" in run.stdout
    assert json.loads(out.read_text()) == {**conversation, "temperature": 0.7, "reasoning_effort": "low"}  # flags win
    run = chat("--reasoning-effort", "max")
    assert run.returncode != 0
    assert "--reasoning-effort must be one of none, minimal, low, medium, high, xhigh, not 'max'" in run.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"messages": "no"}')
    run = chat("--load", str(bad))
    assert run.returncode != 0 and f'cannot load {bad}: not a saved conversation: no "messages" list' in run.stderr
    run = chat("--load", str(tmp_path / "missing.json"))
    assert run.returncode != 0 and "No such file or directory" in run.stderr


def test_repl_reports_an_unreachable_gateway_and_carries_on():
    console = Console(record=True, width=200, file=open("/dev/null", "w"))
    lines = iter(["hello", "/quit"])
    state = ChatState()
    repl("http://127.0.0.1:9", console, state, read=lambda: next(lines))
    assert ("error: cannot reach the gateway at http://127.0.0.1:9 (connection refused): start one "
            "(`specctl up` or `specctl gateway`), or leave out --gateway to chat with an embedded cluster"
            in console.export_text().replace("\n", "")) and state.messages == []


def test_the_chat_starts_by_naming_the_gateways_model_or_why_it_does_not_answer(gateway):
    model = openai.OpenAI(base_url=gateway + "/v1", api_key="x").models.list().data[0].id
    assert greeting(gateway) == f"[dim]chatting with {gateway} (model {model})[/]"
    assert greeting("http://127.0.0.1:9") == (
        "[yellow]cannot reach the gateway at http://127.0.0.1:9 (connection refused): start one (`specctl up` or "
        "`specctl gateway`), or leave out --gateway to chat with an embedded cluster; messages go out once it answers[/]")


async def test_the_chat_says_at_once_that_the_gateway_refused_its_api_key(tiny_dir):
    import asyncio

    from transformers import AutoTokenizer

    from specctl.bench.processes import free_port
    from specctl.gateway.metrics import GatewayMetrics
    from specctl.gateway.server import Gateway, GatewayConfig
    from specctl.gateway.upstream import Upstream

    metrics = GatewayMetrics()
    server = Gateway(GatewayConfig(model_name="tiny", context=512, port=0, api_key="k3y"),
                     AutoTokenizer.from_pretrained(tiny_dir["llama"]),
                     Upstream([f"127.0.0.1:{free_port()}"], metrics=metrics, poll_interval_s=0.1), metrics)
    url = f"http://127.0.0.1:{await server.start()}"
    try:
        assert await asyncio.to_thread(greeting, url, "wrong") == (
            f"[yellow]the gateway at {url}: it refused the API key: pass --api-key (or set SPECCTL_API_KEY)[/]")
        assert await asyncio.to_thread(greeting, url, "k3y") == f"[dim]chatting with {url} (model tiny)[/]"
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def chat_completions_at(handler):
    """Another OpenAI-compatible server: ``handler`` answers POST /v1/chat/completions; yields its URL."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


async def test_a_gateway_that_refuses_return_progress_is_asked_again_without_it_and_no_more():
    """OpenAI's API refuses fields it does not know with a 400 naming them; the chat asks
    once more without llama.cpp's return_progress and leaves it out from then on."""
    bodies = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        if "return_progress" in body:
            return web.json_response({"error": {"message": "Unrecognized request argument supplied: return_progress",
                                                "type": "invalid_request_error", "param": None, "code": None}},
                                     status=400)
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        for chunk in ({"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
                      {"choices": [], "usage": {"completion_tokens": 1}}):
            await reply.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await reply.write(b"data: [DONE]\n\n")
        return reply

    state = ChatState(messages=[{"role": "user", "content": "hello"}])
    async with chat_completions_at(completions) as url:
        assert await stream_reply(url, state, lambda _: None) == ("Hi", {"completion_tokens": 1}, {})
        assert await stream_reply(url, state, lambda _: None) == ("Hi", {"completion_tokens": 1}, {})
        assert ["return_progress" in body for body in bodies] == [True, False, False]
        assert state.ask_progress is False


async def test_other_refusals_are_not_asked_again():
    asked = []

    async def completions(request: web.Request) -> web.Response:
        asked.append(await request.json())
        return web.json_response({"error": {"message": "messages[0] (user) has no content: a user message needs "
                                                      "content"}}, status=400)

    state = ChatState(messages=[{"role": "user", "content": "hello"}])
    async with chat_completions_at(completions) as url:
        with pytest.raises(RuntimeError, match=r"^gateway answered 400: messages\[0\] \(user\) has no content"):
            await stream_reply(url, state, lambda _: None)
        assert len(asked) == 1 and state.ask_progress is True


def tmux(*args):
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=30)


def wait_for(session, needle, timeout, count=1):
    return poll_until(lambda: tmux("capture-pane", "-p", "-J", "-S", "-200", "-t", session).stdout,
                      lambda pane: pane.count(needle) >= count, timeout, interval=0.3)


@needs_tmux
@pytest.mark.parametrize("embedded", [False, True], ids=["gateway", "embedded"])
def test_ctrl_c_stops_a_reply_without_leaving(gateway, tiny_dir, embedded):
    """Against a gateway (REPL in the main thread) and with the embedded cluster (compute in
    the main thread, REPL beside it, Ctrl-C forwarded to the reply)."""
    session = f"specctl-chat-{time.time_ns()}"
    where = (f"--target {tiny_dir['llama']} --draft {tiny_dir['llama']}@2 --mode chain --dtype fp32 --draft-quant none"
             if embedded else f"--gateway {gateway}")
    tmux("new-session", "-d", "-s", session, "-x", "100", "-y", "30",
         f"{sys.executable} -m specctl chat {where} --max-tokens 400")
    try:
        wait_for(session, "you>", 60)
        tmux("send-keys", "-t", session, "tell me everything", "Enter")
        # Ctrl-C once the reply is streaming (text after the prompt), not at a fixed time.
        poll_until(lambda: tmux("capture-pane", "-p", "-J", "-t", session).stdout,
                   lambda pane: "assistant>" in pane and len(pane.split("assistant>")[-1].strip()) >= 8, 30)
        tmux("send-keys", "-t", session, "C-c")
        wait_for(session, "(stopped)", 15)
        wait_for(session, "you>", 15, count=2)
        tmux("send-keys", "-t", session, "/quit", "Enter")
        # The REPL left on /quit: its tmux session ends.
        poll_until(lambda: tmux("has-session", "-t", session).returncode, lambda rc: rc != 0, 15)
    finally:
        tmux("kill-session", "-t", session)


@pytest.mark.slow
@needs_tmux
@needs_qwen
def test_chat_with_no_arguments_answers_a_question():
    session = f"specctl-chat-default-{time.time_ns()}"
    tmux("new-session", "-d", "-s", session, "-x", "120", "-y", "40", f"{sys.executable} -m specctl chat -n 48")
    try:
        pane = wait_for(session, "you>", 600)
        assert "starting an embedded cluster" in pane and "embedded cluster ready" in pane
        tmux("send-keys", "-t", session, "What is the capital of France? Answer in one word.", "Enter")
        pane = wait_for(session, "tok/s, mean accepted length", 600)
        print(pane)
        assert "Paris" in pane.split("assistant>")[1]
        tmux("send-keys", "-t", session, "/quit", "Enter")
    finally:
        tmux("kill-session", "-t", session)
