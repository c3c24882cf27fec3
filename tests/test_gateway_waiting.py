"""Generations that wait for a free session (gateway.waiting): first come first served, bounded
in number and time, and — over a real cluster whose one target holds one session — requests
past its capacity queue and get the same text as alone instead of a 503."""

import asyncio
import json
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specctl.cluster.embedded import ClusterConfig, ClusterThread
from specctl.config import build_config
from specctl.gateway.api import ApiError
from specctl.gateway.waiting import WaitingLine
from specctl.runtime.emulation import SlowedLane
from tests.conftest import poll_until
from tests.test_gateway import PROMPT, post


async def _waiter(line: WaitingLine, name: str, order: list, ticket=None, priority: int = 0):
    await line.wait(ticket or line.ticket(priority))
    order.append(name)


async def _turns(line: WaitingLine, tasks: list) -> None:
    await asyncio.sleep(0)
    for _ in range(len(tasks)):
        line.wake()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)


async def test_turns_come_first_come_first_served_and_a_kept_place_goes_first():
    line, order = WaitingLine(recheck_s=30), []
    kept = line.ticket()  # came first, had a turn without finding a slot, comes back
    tasks = [asyncio.create_task(_waiter(line, name, order)) for name in "abc"]
    await asyncio.sleep(0)
    assert len(line) == 3 and line.ahead(0)
    tasks.append(asyncio.create_task(_waiter(line, "kept", order, ticket=kept)))
    await _turns(line, tasks)
    assert order == ["kept", "a", "b", "c"] and len(line) == 0 and not line.ahead(0)


async def test_with_priorities_lower_goes_first_then_arrival():
    line, order = WaitingLine(recheck_s=30), []
    tasks = [asyncio.create_task(_waiter(line, name, order, priority=p))
             for name, p in (("late", 5), ("b", 0), ("urgent", -1), ("c", 0))]
    await asyncio.sleep(0)
    assert line.ahead(0) and line.ahead(-1) and not line.ahead(-2)  # a newcomer of -2 would overtake them all
    await _turns(line, tasks)
    assert order == ["urgent", "b", "c", "late"]


async def test_the_line_is_bounded_in_number_and_in_time():
    line = WaitingLine(max_waiting=1, timeout_s=0.05, recheck_s=0.01)
    ticket = line.ticket()
    first = asyncio.create_task(line.wait(ticket))
    await asyncio.sleep(0)
    with pytest.raises(ApiError) as full:
        line.ticket()
    assert (full.value.status, full.value.code, full.value.retry_after, str(full.value)) == (
        503, "no_capacity", 1, "every target instance is at capacity and 1 requests are already waiting "
                               "(--max-waiting 1); retry later")
    await first  # the head checks on its own every recheck_s: its turn to try
    with pytest.raises(ApiError, match=r"^every target instance stayed at capacity for the 0.05 s this request may "
                                       r"wait \(--queue-timeout\); retry later$"):
        while True:  # found no slot each time: back at its place until the deadline
            await line.wait(ticket)
    assert len(line) == 0
    with pytest.raises(ApiError, match="0 requests are already waiting"):
        WaitingLine(max_waiting=0).ticket()  # --max-waiting 0: refused at once, as before the line
    with pytest.raises(ValueError):
        WaitingLine(recheck_s=0)


async def test_one_that_gives_up_hands_its_turn_to_the_next():
    line, order = WaitingLine(recheck_s=30), []
    head = asyncio.create_task(_waiter(line, "head", order))
    second = asyncio.create_task(_waiter(line, "second", order))
    await asyncio.sleep(0)
    line.wake()  # the head's turn, but its client goes away before it runs
    head.cancel()
    await asyncio.gather(head, return_exceptions=True)
    await asyncio.wait_for(second, 1)
    assert order == ["second"] and len(line) == 0


@pytest.fixture(scope="module")
def one_session(tiny_dir):
    """One target instance of one session, autoregressive and slowed, behind the gateway."""
    config = build_config(None, target=str(tiny_dir["llama"]), mode="ar", dtype="fp32", max_sessions=1)
    thread = ClusterThread(config, ClusterConfig(targets=1, gateway_port=0, speculate=False))
    urls = thread.start()
    target = thread.cluster.targets[0]
    target.verify_lane = SlowedLane(target.compute, 0.02, 0.0)  # a round as a slow device takes it
    yield thread, urls
    thread.stop()


def _concurrently(url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    results = [None] * len(bodies)

    def send(i):
        code, _, raw = post(url, bodies[i])
        results[i] = code, json.loads(raw)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def _queue_time(exposition: str) -> tuple[float, float]:
    """(count, sum) of the gateway's request_queue_time_seconds histogram."""
    samples = {s.name: s.value for f in text_string_to_metric_families(exposition) for s in f.samples}
    return (samples["specctl:request_queue_time_seconds_count"], samples["specctl:request_queue_time_seconds_sum"])


def test_requests_past_capacity_wait_their_turn_and_get_the_same_text(one_session):
    thread, urls = one_session
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    code, _, raw = post(urls["gateway"] + "/v1/completions", body)
    alone = json.loads(raw)["choices"][0]["text"]
    with urllib.request.urlopen(urls["gateway"] + "/metrics", timeout=30) as response:
        before = _queue_time(response.read().decode())
    seen = []
    watcher = threading.Thread(target=lambda: seen.append(poll_until(
        lambda: len(thread.cluster.gateway.upstream.waiting), lambda waiting: waiting >= 2, timeout=60,
        interval=0.01)))
    watcher.start()
    results = _concurrently(urls["gateway"] + "/v1/completions", [body] * 3)
    watcher.join()
    assert code == 200 and [c for c, _ in results] == [200, 200, 200]
    assert [r["choices"][0]["text"] for _, r in results] == [alone] * 3
    assert seen == [2]  # two waited while the first ran
    with urllib.request.urlopen(urls["gateway"] + "/v1/stats", timeout=30) as response:
        assert json.loads(response.read())["gateway"]["requests_waiting"] == 0  # the line emptied
    with urllib.request.urlopen(urls["gateway"] + "/metrics", timeout=30) as response:
        exposition = response.read().decode()
    assert "\nspecctl:requests_waiting 0.0\n" in exposition  # counted while they waited, then not
    queued = _queue_time(exposition)
    assert queued[0] - before[0] == 3  # one observation a generation
    assert queued[1] - before[1] > 0.1  # two waited while another ran


def test_a_wait_past_the_queue_timeout_is_a_503_and_the_line_empties(one_session):
    thread, urls = one_session
    line = thread.cluster.gateway.upstream.waiting
    line.timeout_s = 0.3
    try:
        long = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        short = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
        first = threading.Thread(target=post, args=(urls["gateway"] + "/v1/completions", long))
        first.start()
        poll_until(lambda: thread.cluster.gateway.upstream.targets[0].inflight, lambda n: n == 1, timeout=30)
        code, headers, raw = post(urls["gateway"] + "/v1/completions", short)
        assert (code, headers["Retry-After"]) == (503, "1")
        assert json.loads(raw)["error"]["message"] == ("every target instance stayed at capacity for the 0.3 s this "
                                                       "request may wait (--queue-timeout); retry later")
        first.join(120)
        assert len(line) == 0
        code, _, _ = post(urls["gateway"] + "/v1/completions", short)
        assert code == 200  # nothing stuck
    finally:
        line.timeout_s = 600.0


def test_a_client_that_leaves_while_waiting_leaves_the_line(one_session):
    thread, urls = one_session
    upstream = thread.cluster.gateway.upstream
    long = {"prompt": PROMPT, "max_tokens": 120, "temperature": 0, "ignore_eos": True}  # >= 2.4 s at 20 ms a round
    result = []
    first = threading.Thread(target=lambda: result.append(post(urls["gateway"] + "/v1/completions", long)[0]))
    first.start()
    poll_until(lambda: upstream.targets[0].inflight, lambda n: n == 1, timeout=30, interval=0.01)
    request = urllib.request.Request(urls["gateway"] + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({**long, "max_tokens": 4}).encode())
    with pytest.raises(OSError):  # the client gives up (a timeout) while its generation waits
        urllib.request.urlopen(request, timeout=0.5)
    poll_until(lambda: len(upstream.waiting), lambda n: n == 0, timeout=30, interval=0.01)
    assert first.is_alive()  # it left the line by leaving, not by getting the session
    first.join(120)
    assert result == [200] and upstream.targets[0].inflight == 0
    with urllib.request.urlopen(urls["gateway"] + "/metrics", timeout=30) as response:
        assert "\nspecctl:requests_waiting 0.0\n" in response.read().decode()


def _events(response) -> list:
    """A stream's events, [DONE] as the string."""
    lines = [line.decode().removeprefix("data: ").strip() for line in response if line.startswith(b"data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def test_a_streamed_batch_past_the_sessions_streams_its_first_choice_while_the_rest_wait(one_session):
    """As vLLM streams the choices it runs while the others queue (the stream began only once
    the last choice started, after the first two had ended); each text is then what a request
    alone gets."""
    thread, urls = one_session
    upstream = thread.cluster.gateway.upstream
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}  # >= 0.48 s at 20 ms a round
    alone = json.loads(post(urls["gateway"] + "/v1/completions", body)[2])["choices"][0]["text"]
    request = urllib.request.Request(urls["gateway"] + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({**body, "n": 3, "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        first = response.readline()
        waiting = len(upstream.waiting)
        events = _events(response)
    assert first.startswith(b"data: ") and json.loads(first[6:])["choices"][0]["index"] == 0
    assert waiting == 2  # choices 1 and 2 wait their turn for the one session
    texts = {}
    for event in [json.loads(first[6:])] + events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: alone, 1: alone, 2: alone} and events[-1] == "[DONE]"
    assert len(upstream.waiting) == 0 and upstream.targets[0].inflight == 0


def test_a_choice_that_waits_past_the_queue_timeout_ends_its_request_streamed_or_not(one_session):
    """A choice still waiting when its siblings' stream began ends it with the 503 it met,
    in the stream (headers are gone), and frees its running siblings; whole, the request's 503."""
    thread, urls = one_session
    upstream = thread.cluster.gateway.upstream
    upstream.waiting.timeout_s = 0.3
    body = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "n": 2}  # >= 1.2 s
    message = "every target instance stayed at capacity for the 0.3 s this request may wait (--queue-timeout); retry later"
    try:
        request = urllib.request.Request(urls["gateway"] + "/v1/completions", data=json.dumps(
            {**body, "stream": True}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            events = _events(response)
        assert events[-2:] == [{"error": {"message": message, "type": "server_error", "param": None,
                                          "code": "no_capacity"}}, "[DONE]"]
        assert {choice["index"] for event in events[:-2] for choice in event["choices"]} == {0}
        poll_until(lambda: upstream.targets[0].inflight, lambda n: n == 0, timeout=30, interval=0.01)
        code, headers, raw = post(urls["gateway"] + "/v1/completions", body)
        assert (code, headers["Retry-After"], json.loads(raw)["error"]["message"]) == (503, "1", message)
        assert len(upstream.waiting) == 0
        poll_until(lambda: upstream.targets[0].inflight, lambda n: n == 0, timeout=30, interval=0.01)
        # SGLang's /generate, a batch of two streamed: its error event
        code, _, raw = post(urls["gateway"] + "/generate", {"text": [PROMPT, PROMPT], "stream": True, "sampling_params": {
            "max_new_tokens": 60, "temperature": 0, "ignore_eos": True}})
        lines = [line.removeprefix("data: ") for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert code == 200 and lines[-1] == "[DONE]"
        assert json.loads(lines[-2]) == {"error": {"message": message, "code": 503}}
        poll_until(lambda: upstream.targets[0].inflight, lambda n: n == 0, timeout=30, interval=0.01)
    finally:
        upstream.waiting.timeout_s = 600.0


def test_priority_is_refused_unless_the_policy_is_priority(one_session):
    thread, urls = one_session
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "priority": -5}
    code, _, raw = post(urls["gateway"] + "/v1/completions", body)
    assert code == 400 and json.loads(raw)["error"] == {
        "message": "priority scheduling is not enabled: start the gateway with --scheduling-policy priority, or "
                   "leave priority out", "type": "invalid_request_error", "param": "priority", "code": None}
    config = thread.cluster.gateway.config
    config.scheduling_policy = "priority"  # as --scheduling-policy priority sets it
    try:
        assert post(urls["gateway"] + "/v1/completions", body)[0] == 200
        assert post(urls["gateway"] + "/v1/responses", {"input": "hi", "max_output_tokens": 2, "priority": 3})[0] == 200
        upstream, done = thread.cluster.gateway.upstream, []

        def send(name, priority, tokens=12):
            code, _, _ = post(urls["gateway"] + "/v1/completions", {
                "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "priority": priority})
            done.append((name, code))

        senders = [threading.Thread(target=send, args=("occupant", 0, 48))]
        senders[0].start()
        poll_until(lambda: upstream.targets[0].inflight, lambda n: n == 1, timeout=30, interval=0.01)
        for name, priority in (("late", 5), ("urgent", -1)):  # the urgent one comes second and goes first
            senders.append(threading.Thread(target=send, args=(name, priority)))
            senders[-1].start()
            poll_until(lambda: len(upstream.waiting), lambda n: n == len(senders) - 1, timeout=30, interval=0.01)
        for sender in senders:
            sender.join(120)
        assert done == [("occupant", 200), ("urgent", 200), ("late", 200)]
    finally:
        config.scheduling_policy = "fcfs"
