"""A stream whose first token is long in coming (gateway.keepalive): its headers and SSE
comments go while it waits, then its events as ever — the same text as a request that did not
wait — and a failure after the headers is the stream's last event, in its endpoint's shape."""

import json
import threading
import time
import urllib.request

import pytest

from specctl.gateway import keepalive
from tests.test_gateway import PROMPT, post
from tests.test_gateway_waiting import one_session  # noqa: F401 - the fixture: one slowed session

BODY = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}  # >= 0.8 s at 20 ms a round


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(keepalive, "HEADERS_AFTER_S", 0.2)
    monkeypatch.setattr(keepalive, "KEEPALIVE_S", 0.2)


def _occupied(url: str) -> threading.Thread:
    """The one session taken by a whole request for the next second or so."""
    runner = threading.Thread(target=post, args=(url + "/v1/completions", BODY))
    runner.start()
    time.sleep(0.15)
    return runner


def _stream(url: str, path: str, body: dict) -> tuple[float, list[bytes]]:
    """(seconds to the headers, the stream's lines)."""
    request = urllib.request.Request(url + path, headers={"Content-Type": "application/json"},
                                     data=json.dumps({**body, "stream": True}).encode())
    sent = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as response:
        headed = time.perf_counter() - sent
        assert response.status == 200 and response.headers["Content-Type"] == "text/event-stream"
        return headed, [line for line in response.read().split(b"\n\n") if line]


def test_a_stream_that_waits_gets_its_headers_and_comments_then_the_same_text(one_session, quick):  # noqa: F811
    _, urls = one_session
    url = urls["gateway"]
    alone = json.loads(post(url + "/v1/completions", BODY)[2])["choices"][0]["text"]
    runner = _occupied(url)
    headed, lines = _stream(url, "/v1/completions", BODY)
    runner.join()
    comments = [line for line in lines if line.startswith(b":")]
    assert headed < 0.6 and len(comments) >= 2  # headers at 0.2 s, a comment every 0.2 s of the wait
    assert set(comments) == {keepalive.COMMENT.strip()}
    events = [line.removeprefix(b"data: ").decode() for line in lines if line.startswith(b"data: ")]
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == alone and events[-1] == "[DONE]"


PING = b'event: ping\ndata: {"type": "ping"}'


@pytest.mark.parametrize("path, body, opening, beat, last", [
    ("/v1/completions", BODY, 0, keepalive.COMMENT.strip(),
     [b'data: {"error": {"message": "MESSAGE", "type": "server_error", "param": null, "code": "no_capacity"}}',
      b"data: [DONE]"]),
    # Anthropic's: message_start first (its clients want it before any other event), then pings, which
    # Claude Code's watchdog counts as events
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}, 1, PING,
     [b'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", "message": "MESSAGE"}}'])])
def test_a_failure_after_the_headers_is_the_stream_s_last_event(one_session, quick, path, body, opening, beat,  # noqa: F811
                                                               last):
    thread, urls = one_session
    upstream = thread.cluster.gateway.upstream
    timeout_s, upstream.waiting.timeout_s = upstream.waiting.timeout_s, 0.5
    try:
        runner = _occupied(urls["gateway"])
        _, lines = _stream(urls["gateway"], path, body)
        runner.join()
    finally:
        upstream.waiting.timeout_s = timeout_s
    message = ("every target instance stayed at capacity for the 0.5 s this request may wait (--queue-timeout); "
               "retry later").encode()
    if opening:
        start = json.loads(lines[0].split(b"data: ")[1])
        assert lines[0].startswith(b"event: message_start\n") and start["message"]["content"] == []
    waited, ended = lines[opening: -len(last)], lines[-len(last):]
    assert waited and set(waited) == {beat}
    assert ended == [line.replace(b"MESSAGE", message) for line in last]


def test_a_message_stream_that_waits_opens_once_and_goes_on_as_one_that_did_not(one_session, quick):  # noqa: F811
    _, urls = one_session
    url = urls["gateway"]
    body = {"max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    alone = json.loads(post(url + "/v1/messages", body)[2])["content"][0]["text"]
    runner = _occupied(url)
    _, lines = _stream(url, "/v1/messages", body)
    runner.join()
    kinds = [line.split(b"\n")[0].removeprefix(b"event: ").decode() for line in lines]
    assert kinds.count("message_start") == 1 and kinds[0] == "message_start" and kinds.count("ping") >= 3
    texts = [json.loads(line.split(b"data: ")[1])["delta"]["text"] for line in lines
             if line.startswith(b"event: content_block_delta")]
    assert "".join(texts) == alone and kinds[-1] == "message_stop"


def test_a_response_stream_that_could_not_start_after_its_headers_fails_in_its_own_events(one_session, quick):  # noqa: F811
    """The Responses API's stream: after the comments, response.created and response.failed with
    the error, as it ends a stream whose generation failed mid-way."""
    thread, urls = one_session
    upstream = thread.cluster.gateway.upstream
    timeout_s, upstream.waiting.timeout_s = upstream.waiting.timeout_s, 0.5
    try:
        runner = _occupied(urls["gateway"])
        _, lines = _stream(urls["gateway"], "/v1/responses", {"input": "Hi", "max_output_tokens": 8})
        runner.join()
    finally:
        upstream.waiting.timeout_s = timeout_s
    waited = [line for line in lines if line.startswith(b":")]
    events = [json.loads(line.split(b"data: ")[1]) for line in lines if not line.startswith(b":")]
    assert waited and lines[: len(waited)] == waited  # the comments first
    assert [event["type"] for event in events] == ["response.created", "response.in_progress", "response.failed"]
    assert events[-1]["response"]["error"] == {"code": "no_capacity", "message": (
        "every target instance stayed at capacity for the 0.5 s this request may wait (--queue-timeout); retry later")}
