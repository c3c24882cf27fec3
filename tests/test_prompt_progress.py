"""llama.cpp's return_progress: a streamed request that asks is told, after each chunk of its
prompt the target prefills, how far the prompt is read (net PromptProgress, prompt_progress in
the stream) — in OpenAI's chat and completions and llama.cpp's /completion, over a real
cluster (tiny fp32 models, loopback TCP and HTTP) whose targets prefill 8 tokens a chunk; the
text is the one the same request gets without it, and `specctl chat` shows it while it waits;
`specctl generate` shows a bar of the same chunks and notes what the prompt took."""

import asyncio
import io
import json
import urllib.request

import pytest
from rich.console import Console

from specctl.cli.prompt_reading import prompt_bar, prompt_note, remote_statistic
from specctl.spec.rounds import run_to_end
from specctl.spec.stats import GenerationStats

from specctl.chat.commands import ChatState
from specctl.chat.repl import Reading, reading_line, stream_reply
from specctl.net.protocol import Done, PromptProgress, Tokens
from specctl.spec.params import SamplingParams
from specctl.verify.client import TargetConnection, probe, remote_generate
from specctl.verify.prefills import Prefills
from tests.conftest import poll_until, running_cluster
from tests.test_gateway import post

CHUNK = 8


@pytest.fixture(scope="module")
def chunked_cluster(tiny_dir):
    for thread, urls in running_cluster(tiny_dir):
        for server in thread.cluster.targets:
            server.model.decoder.prefill_chunk = CHUNK
        yield thread, urls


def _events(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]


def _text(choice: dict) -> str:
    return choice.get("delta", {}).get("content") or choice.get("text") or ""


def _check_steps(progress: list[dict], total: int) -> None:
    """Chunk by chunk from what the prefix cache restored, the last with the whole prompt."""
    cache = progress[0]["cache"]
    assert [p["total"] for p in progress] == [total] * len(progress)
    assert [p["cache"] for p in progress] == [cache] * len(progress)
    assert [p["processed"] for p in progress] == [*range(cache + CHUNK, total, CHUNK), total]
    times = [p["time_ms"] for p in progress]
    assert times == sorted(times) and times[0] >= 0


def test_a_target_sends_the_prefill_s_progress_before_the_first_token_only_when_asked(chunked_cluster):
    host, port = chunked_cluster[1]["targets"][0].rsplit(":", 1)
    prompt = [(7 * i + 3) % 200 + 1 for i in range(29)]

    async def run(asked: bool) -> list:
        connection = await TargetConnection(host, int(port)).connect()
        try:
            stream = connection.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True, prompt_progress=asked))
            messages = [await stream.next()]
            while not isinstance(messages[-1], Done):
                messages.append(await stream.next())
            return messages
        finally:
            connection.close()

    asked = asyncio.run(run(True))
    progress = [m for m in asked if isinstance(m, PromptProgress)]
    first_tokens = next(i for i, m in enumerate(asked) if isinstance(m, Tokens))
    assert progress == asked[:first_tokens] and progress[0].cache == 0
    _check_steps([{"total": p.total, "cache": p.cache, "processed": p.processed, "time_ms": p.time_ms}
                  for p in progress], 29)
    plain = asyncio.run(run(False))
    assert not any(isinstance(m, PromptProgress) for m in plain)
    tokens = lambda messages: [t for m in messages if isinstance(m, Tokens) for t in m.tokens]  # noqa: E731
    assert tokens(asked) == tokens(plain) and len(tokens(plain)) == 4


def test_generate_remote_is_handed_each_progress_and_writes_the_same_tokens(chunked_cluster):
    host, port = chunked_cluster[1]["targets"][1].rsplit(":", 1)
    prompt = [(11 * i + 5) % 200 + 1 for i in range(21)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    seen: list[PromptProgress] = []
    tokens, reason, _ = asyncio.run(remote_generate(host, int(port), prompt, params, on_progress=seen.append))
    _check_steps([{"total": p.total, "cache": p.cache, "processed": p.processed, "time_ms": p.time_ms}
                  for p in seen], 21)
    assert (tokens, reason) == asyncio.run(remote_generate(host, int(port), prompt, params))[:2] and len(tokens) == 5


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_stream_that_asks_gets_prompt_progress_chunks_then_the_same_text(chunked_cluster, route):
    base = chunked_cluster[1]["gateway"]
    text = "Progress " + route + " " + " ".join(f"w{i}" for i in range(30))  # its own: nothing cached of it
    body = ({"messages": [{"role": "user", "content": text}]} if route == "chat" else {"prompt": text})
    body |= {"max_tokens": 6, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    url = base + ("/v1/chat/completions" if route == "chat" else "/v1/completions")
    status, _, raw = post(url, {**body, "return_progress": True})
    assert status == 200
    events = _events(raw)
    progress = [e for e in events if "prompt_progress" in e]
    usage = events[-1]["usage"]
    _check_steps([e["prompt_progress"] for e in progress], usage["prompt_tokens"])
    first_text = next(i for i, e in enumerate(events) if e["choices"] and _text(e["choices"][0]))
    assert all(events.index(e) < first_text for e in progress)
    for e in progress:  # llama.cpp's shape: an empty delta beside it
        choice = e["choices"][0]
        assert (choice["delta"] == {} if route == "chat" else choice["text"] == "") and choice["finish_reason"] is None
    status, _, plain = post(url, body)
    pieces = lambda evs: "".join(_text(e["choices"][0]) for e in evs if e["choices"])  # noqa: E731
    assert status == 200 and not any("prompt_progress" in e for e in _events(plain))
    assert pieces(events) == pieces(_events(plain)) and pieces(events)
    whole_status, _, whole = post(url, {**body, "stream": False, "stream_options": None, "return_progress": True})
    assert whole_status == 200 and "prompt_progress" not in json.loads(whole)  # streams only, as llama.cpp's


def test_llama_cpp_s_completion_streams_prompt_progress_events(chunked_cluster):
    base = chunked_cluster[1]["gateway"]
    body = {"prompt": "llama progress " + " ".join(f"v{i}" for i in range(30)), "n_predict": 4, "temperature": 0,
            "stream": True}
    status, _, raw = post(base + "/completion", {**body, "return_progress": True})
    assert status == 200
    events = _events(raw)
    progress = [e for e in events if "prompt_progress" in e]
    assert progress and all(e["content"] == "" and e["tokens"] == [] and not e["stop"] for e in progress)
    _check_steps([e["prompt_progress"] for e in progress], progress[0]["tokens_evaluated"])
    _, _, plain = post(base + "/completion", body)
    text = lambda evs: "".join(e.get("content", "") for e in evs)  # noqa: E731
    assert text(events) == text(_events(plain)) and not any("prompt_progress" in e for e in _events(plain))


def test_return_progress_must_be_a_boolean(chunked_cluster):
    base = chunked_cluster[1]["gateway"]
    status, _, raw = post(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "stream": True, "return_progress": "yes"})
    assert status == 400 and "return_progress" in json.loads(raw)["error"]["message"]


def test_the_chat_client_asks_for_progress_and_hands_each_to_its_status(chunked_cluster):
    base = chunked_cluster[1]["gateway"]
    state = ChatState(max_tokens=4)
    state.messages.append({"role": "user", "content": "chat progress " + " ".join(f"u{i}" for i in range(30))})
    assert state.request_body()["return_progress"] is True
    seen: list[dict] = []
    text, usage, _ = asyncio.run(stream_reply(base, state, lambda delta: None, on_progress=seen.append))
    _check_steps(seen, usage["prompt_tokens"])
    assert text


def test_the_status_line_says_how_far_the_prompt_is_read():
    assert reading_line(None, 3.4) == "waiting for the reply (3 s)"
    reading = Reading()  # the status's text, its seconds counted at each refresh
    reading.started -= 61
    assert reading.__rich__() == "waiting for the reply (61 s)"
    reading.progress = {"total": 100, "cache": 0, "processed": 50, "time_ms": 1.0}
    assert reading.__rich__() == "reading the prompt: 50 of 100 tokens (50%, 61 s)"
    assert reading_line({"total": 3245, "cache": 0, "processed": 1024, "time_ms": 9000.0}, 9.2) == (
        "reading the prompt: 1,024 of 3,245 tokens (32%, 9 s)")
    assert reading_line({"total": 2000, "cache": 1500, "processed": 1500, "time_ms": 10.0}, 0.4) == (
        "reading the prompt: 1,500 of 2,000 tokens, 1,500 from the cache (75%, 0 s)")


def test_generate_s_bar_follows_each_chunk_and_is_gone_before_the_first_token(tiny):
    target = tiny["llama"]
    prompt = [(5 * i + 1) % 200 + 1 for i in range(37)]
    seen: list[tuple[int, bool]] = []
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    target.prefill_chunk = CHUNK
    try:
        with prompt_bar(console, len(prompt)) as prefilled:
            def noted(session):
                prefilled(session)
                seen.append((session.prefilled, prefilled.showing))

            session = run_to_end(target, prompt, SamplingParams(max_tokens=3, ignore_eos=True), prefilled=noted,
                                 on_tokens=lambda tokens, result: seen.append((-1, prefilled.showing)))
    finally:
        target.prefill_chunk = 0
    assert seen[:5] == [(8, True), (16, True), (24, True), (32, True), (37, False)]  # stopped with the last chunk
    assert all(entry == (-1, False) for entry in seen[5:]) and len(session.output) == 3
    assert "reading the prompt" in out.getvalue()
    plain = Console(file=io.StringIO(), force_terminal=False)
    with prompt_bar(plain, 37) as prefilled:  # piped: nothing drawn, the callback takes the session and does nothing
        prefilled(session)
        assert not prefilled.showing
    assert plain.file.getvalue() == ""


def test_the_statistic_notes_a_prompt_that_took_a_second_or_more():
    stats = GenerationStats(prompt_tokens=3245, new_tokens=64, prefill_s=42.66, wall_s=67.28)
    assert prompt_note(stats) == " (prompt 3,245 tokens read in 42.7 s; 2.60 tok/s after it)"
    assert prompt_note(GenerationStats(prompt_tokens=20, new_tokens=64, prefill_s=0.4, wall_s=6.0)) == ""


class _Reading:  # what Prefills reads of a DecodeSession
    def __init__(self, prompt_len: int, prefilled: int | None = None) -> None:
        self.prompt_len, self.prefilled, self.stats = prompt_len, prefilled, GenerationStats(cached_prompt_tokens=4)


def test_a_target_counts_the_prompts_it_reads_and_the_tokens_left_until_each_is_in_or_ends():
    prefills, sent = Prefills(), []
    long, short = _Reading(3000), _Reading(40)
    long_done = prefills.watch(long, 1, sent.append)
    prefills.watch(short, 2)  # did not ask: counted, told nothing
    assert prefills.snapshot() == {"prefill_sessions": 2, "prefill_tokens_left": 3040}
    long.prefilled = 512
    long_done()
    assert prefills.snapshot() == {"prefill_sessions": 2, "prefill_tokens_left": 2528}
    assert [(m.req, m.total, m.cache, m.processed) for m in sent] == [(1, 3000, 4, 512)]
    long.prefilled = 3000
    long_done()  # its last chunk: no longer counted
    assert prefills.snapshot() == {"prefill_sessions": 1, "prefill_tokens_left": 40} and sent[-1].processed == 3000
    prefills.done(short)  # cancelled before its first chunk
    assert prefills.snapshot() == {"prefill_sessions": 0, "prefill_tokens_left": 0}


def test_a_target_s_stats_count_no_prompt_reading_once_its_sessions_are_done(chunked_cluster):
    address = chunked_cluster[1]["targets"][0]
    host, port = address.rsplit(":", 1)
    asyncio.run(remote_generate(host, int(port), list(range(1, 40)), SamplingParams(max_tokens=2, ignore_eos=True)))
    stats = asyncio.run(probe(host, int(port)))[1]
    assert stats["prefill_sessions"] == 0 and stats["prefill_tokens_left"] == 0
    assert chunked_cluster[0].cluster.targets[0].prefills.sessions == {}

    def gauges() -> list[str]:
        with urllib.request.urlopen(chunked_cluster[1]["gateway"] + "/metrics", timeout=30) as response:
            metrics = response.read().decode()
        return [line for line in metrics.split("\n")
                if line.startswith(("specctl:prefill_sessions{", "specctl:prefill_tokens_left{"))]

    # two targets, two gauges each; the gateway's poller may still hold a snapshot taken mid-prefill
    poll_until(gauges, lambda lines: len(lines) == 4 and all(line.endswith(" 0.0") for line in lines), 30)


def test_generate_remote_s_statistic_notes_the_prompt_the_target_read_for_a_second_or_more():
    stats = {"prompt_tokens": 1403, "prefill_ms": 19000.0, "mean_accepted_length": 6.0}
    assert remote_statistic(12, 19.89, "127.0.0.1:41055", "qwen2.5-coder-1.5b", stats) == (
        "12 tokens in 19.89s via 127.0.0.1:41055 (qwen2.5-coder-1.5b), mean accepted length 6.00 "
        "(prompt 1,403 tokens read in 19.0 s; 13.48 tok/s after it)")
    quick = {**stats, "prefill_ms": 120.0}
    assert remote_statistic(12, 2.0, "h:1", "m", quick) == "12 tokens in 2.00s via h:1 (m), mean accepted length 6.00"
