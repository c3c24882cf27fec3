"""A generation resumed from the output a lost instance already sent (DecodeSession's
``resumed``, GENERATE's, the gateway's failover mid-stream): what follows is what the
uninterrupted generation gives — token for token greedy, in every mode, with the logit
rules, a grammar and a thinking budget counting the resumed output as output — and the
resumed tokens are never sent again."""

import asyncio
import contextlib
import dataclasses
import json
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specctl.cluster.embedded import ClusterConfig, ClusterThread
from specctl.config import build_config
from specctl.errors import BadRequest
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate
from tests.conftest import mode_drafter, poll_until
from tests.test_gateway import PROMPT as TEXT_PROMPT, post
from tests.test_logit_rules import PENALIZED, PROMPT
from tests.test_structured import CONSTRAINTS, EOS, byte_tokenizer  # noqa: F401 - the fixture

PLAIN = SamplingParams(max_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("params", [PLAIN, PENALIZED], ids=["plain", "penalized"])
@pytest.mark.parametrize("mode", ["ar", "chain", "tree", "ngram"])
def test_a_resumed_generation_goes_on_as_the_uninterrupted_one(tiny, mode, params):
    target = tiny["llama"]
    whole, _, reason = generate(target, PROMPT, params)
    for cut in (1, 9, 31):
        sent = []
        output, stats, resumed_reason = generate(target, PROMPT, params, mode_drafter(mode, tiny["llama-draft"]),
                                                 on_tokens=lambda tokens, _result: sent.extend(tokens),
                                                 resumed=tuple(whole[:cut]))
        assert output == whole and resumed_reason == reason == "length"
        assert sent == whole[cut:]  # the resumed tokens are not sent again
        assert stats.new_tokens == len(whole) - cut and stats.prompt_tokens == len(PROMPT)


def test_the_penalties_count_the_resumed_output(tiny):
    """Resumed as if it were prompt, the penalties would read another text: the rules must
    have recorded it as output (the case above then tells the two apart)."""
    target = tiny["llama"]
    whole = generate(target, PROMPT, PENALIZED)[0]
    as_prompt = generate(target, PROMPT + whole[:9], dataclasses.replace(PENALIZED, max_tokens=23))[0]
    assert whole[:9] + as_prompt != whole


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_a_grammar_goes_on_from_the_resumed_output(tiny, byte_tokenizer, kind):  # noqa: F811
    target = tiny["llama"]
    params = SamplingParams(max_tokens=40, structured=CONSTRAINTS[kind])
    prompt = byte_tokenizer.encode("answer: ")
    whole, _, reason = generate(target, prompt, params, eos_token_ids=(EOS,), tokenizer=byte_tokenizer)
    assert reason == "stop" and len(whole) > 4
    output, _, resumed_reason = generate(target, prompt, params, mode_drafter("chain", tiny["llama-draft"]),
                                         eos_token_ids=(EOS,), tokenizer=byte_tokenizer, resumed=tuple(whole[:4]))
    assert output == whole and resumed_reason == "stop"


def test_a_thinking_budget_counts_the_resumed_thought(tiny):
    start, end = 250, 251
    prompt = [1, 5, 9, 2, 7, start]  # the prompt opened a thought
    params = SamplingParams(max_tokens=24, ignore_eos=True, thinking_budget=3, thinking_markers=((start,), (end,)))
    whole = generate(tiny["llama"], prompt, params)[0]
    assert whole[3] == end
    assert generate(tiny["llama"], prompt, params, resumed=tuple(whole[:2]))[0] == whole


def test_a_resumed_output_that_leaves_nothing_to_generate_is_refused(tiny):
    with pytest.raises(BadRequest, match=r"^a resumed generation's 32 tokens leave none of max_tokens 32 to generate$"):
        generate(tiny["llama"], PROMPT, PLAIN, resumed=tuple(range(32)))


@contextlib.contextmanager
def two_targets(tiny_dir, max_sessions: int):
    """(thread, urls) of two target instances, a chain draft server and a gateway in this process."""
    config = build_config(None, target=str(tiny_dir["llama"]), draft=str(tiny_dir["llama-draft"]), mode="chain",
                          dtype="fp32", max_sessions=max_sessions)
    thread = ClusterThread(config, ClusterConfig(targets=2, gateway_port=0))
    urls = thread.start()
    try:
        yield thread, urls
    finally:
        thread.stop()


def slowed(thread: ClusterThread) -> list[int]:
    """Rounds as a slow device takes them from now, so that a loss comes mid-stream; each
    target's tokens so far."""
    for target in thread.cluster.targets:
        target.config = dataclasses.replace(target.config, verify_delay_s=0.03)
    return [target.totals.new_tokens for target in thread.cluster.targets]


def _lose_a_serving_target(thread: ClusterThread, before: list[int]) -> int:
    """Close a target instance that is streaming tokens (more than ``before``, its tokens
    before the request); its index."""
    def serving():
        return [i for i, t in enumerate(thread.cluster.targets) if t.active and t.totals.new_tokens > before[i]]
    index = poll_until(serving, bool, timeout=30)[0]
    asyncio.run_coroutine_threadsafe(thread.cluster.targets[index].close(), thread.loop).result(30)
    return index


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_target_lost_mid_generation_is_taken_over_by_another_with_the_same_output(tiny_dir, stream):
    """Two target instances behind the gateway and a draft server; the one streaming a
    request's two choices is closed mid-stream: the other goes on from their output so far, and
    the client gets the same text as from an uninterrupted generation, each token once."""
    with two_targets(tiny_dir, 4) as (thread, urls):
        url = urls["gateway"] + "/v1/completions"
        body = {"prompt": TEXT_PROMPT, "max_tokens": 120, "temperature": 0, "ignore_eos": True}
        code, _, raw = post(url, body)
        assert code == 200
        reference = json.loads(raw)["choices"][0]["text"]
        before = slowed(thread)
        request = urllib.request.Request(url, data=json.dumps({**body, "n": 2, "stream": stream}).encode(),
                                         headers={"Content-Type": "application/json"})
        if stream:
            with urllib.request.urlopen(request, timeout=120) as response:
                lines = [response.readline()]
                lost = _lose_a_serving_target(thread, before)
                lines += [line for line in response if line.strip()]
            data = [line.decode().removeprefix("data: ").strip() for line in lines if line.startswith(b"data: ")]
            assert data[-1] == "[DONE]"
            chunks = [json.loads(d) for d in data[:-1]]
            assert all("error" not in c for c in chunks)
            texts = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in (0, 1)]
            # each choice's last chunk: its stats, saying whether (and from where) it was resumed
            summaries = [c["specctl"] for c in chunks if "specctl" in c]
            assert len(summaries) == 2
            resumes = sum(summary.get("resumes", 0) for summary in summaries)
            assert all(0 < summary["resumed_tokens"] < 120 for summary in summaries if "resumes" in summary)
        else:
            answer = {}
            waiting = threading.Thread(target=lambda: answer.update(zip(("code", "raw"), post(url, request.data)[::2])))
            waiting.start()
            lost = _lose_a_serving_target(thread, before)
            waiting.join(120)
            assert answer["code"] == 200, answer["raw"][:300]
            choices = sorted(json.loads(answer["raw"])["choices"], key=lambda c: c["index"])
            texts = [c["text"] for c in choices]
            usage = json.loads(answer["raw"])["usage"]
            resumes = json.loads(answer["raw"])["specctl"]["resumes"]
            assert usage["completion_tokens"] == 240
            # the other instance's prefix cache held the reference's prompt and output: of the prompt's only
            assert usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
        assert texts == [reference, reference]
        assert not thread.cluster.gateway.upstream.targets[lost].up
        with urllib.request.urlopen(urls["gateway"] + "/metrics", timeout=10) as response:
            samples = {s.name: s.value for family in text_string_to_metric_families(response.read().decode())
                       for s in family.samples}
        assert samples["specctl:resumed_generations_total"] in (1, 2)  # the lost instance's choices
        assert resumes == samples["specctl:resumed_generations_total"]
        with urllib.request.urlopen(urls["gateway"] + "/v1/stats", timeout=10) as response:
            assert json.load(response)["gateway"]["resumed_generations"] == samples["specctl:resumed_generations_total"]


@pytest.mark.parametrize("stages", [2, 3])
async def test_specpipe_goes_on_from_a_resumed_output_as_the_uninterrupted_target(tiny_dir, stages):
    """A pipelined target's SpecPipe run prefills the resumed output with the prompt and
    drafts its first tree from there."""
    from specctl.engine.loader import load_model
    from specctl.pipeline.local import LocalPipeline
    from specctl.pipeline.specpipe import specpipe_generate
    from specctl.pipeline.token_source import TreeShape

    target = load_model("t", tiny_dir["llama"], "fp32")
    draft = load_model("d", tiny_dir["llama"], "fp32", num_layers=2)
    whole = generate(target.decoder, PROMPT, PENALIZED)[0]
    async with LocalPipeline(target, stages) as pipeline:
        for cut in (1, 12):
            tokens, stats, reason, _pipe = await asyncio.to_thread(
                specpipe_generate, pipeline.staged.decoder, draft.decoder, PROMPT, PENALIZED, TreeShape(3, 2),
                resumed=tuple(whole[:cut]))
            assert tokens == whole and reason == "length" and stats.new_tokens == len(whole) - cut


def test_concurrent_requests_on_a_lost_target_all_go_on_elsewhere_with_their_own_text(tiny_dir):
    """Six streamed requests spread over two instances; one instance is closed under them:
    every request ends with its uninterrupted text, whichever instance finished it."""
    with two_targets(tiny_dir, 8) as (thread, urls):
        url = urls["gateway"] + "/v1/completions"
        prompts = [f"{TEXT_PROMPT} {word}" for word in ("one", "two", "three", "four", "five", "six")]
        bodies = [{"prompt": p, "max_tokens": 80, "temperature": 0, "ignore_eos": True} for p in prompts]
        references = []
        for body in bodies:
            code, _, raw = post(url, body)
            assert code == 200
            references.append(json.loads(raw)["choices"][0]["text"])
        before = slowed(thread)
        texts: list = [None] * len(bodies)

        def stream(i: int) -> None:
            request = urllib.request.Request(url, data=json.dumps({**bodies[i], "stream": True}).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                chunks = [json.loads(line[6:]) for line in response
                          if line.startswith(b"data: ") and line.strip() != b"data: [DONE]"]
            texts[i] = "".join(c["choices"][0]["text"] if "choices" in c else f"<{c['error']['message']}>"
                               for c in chunks)

        clients = [threading.Thread(target=stream, args=(i,)) for i in range(len(bodies))]
        for client in clients:
            client.start()
        poll_until(lambda: [t.active for t in thread.cluster.targets], lambda active: all(active), timeout=30)
        lost = _lose_a_serving_target(thread, before)
        for client in clients:
            client.join(120)
        assert texts == references
        assert thread.cluster.gateway.metrics.resumed_count() >= 1
        assert not thread.cluster.gateway.upstream.targets[lost].up


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except OSError:
        return 0


@pytest.mark.slow  # processes, and 10 s of silence to wait out (~35 s); the unit case is tests/test_upstream.py
def test_a_hung_target_process_is_given_up_and_its_stream_goes_on_elsewhere(tiny_dir):
    """Two target processes and a gateway process; the one streaming a request is stopped
    (SIGSTOP: its connections stay open, nothing comes): once its polls have gone unanswered
    for STALLED_AFTER_S the gateway gives it up and the other goes on, the same text; resumed
    (SIGCONT), the stopped one frees the session it held."""
    import os
    import signal
    import time

    from specctl.bench.processes import free_ports, spawn_role, stop_processes, wait_listening
    from specctl.verify.client import remote_stats

    ports = free_ports(3)
    targets = [spawn_role("verify", "--model", str(tiny_dir["llama"]), "--dtype", "fp32", "--port", str(port),
                          "--verify-delay-ms", "30") for port in ports[:2]]
    procs = list(targets)
    try:
        for proc in targets:
            wait_listening(proc, "target")
        procs.append(spawn_role("gateway", *(arg for port in ports[:2] for arg in ("--target", f"127.0.0.1:{port}")),
                                "--port", str(ports[2])))
        url = f"http://127.0.0.1:{ports[2]}"
        poll_until(lambda: _status(url + "/health"), lambda status: status == 200, timeout=60)
        body = {"prompt": TEXT_PROMPT, "max_tokens": 160, "temperature": 0, "ignore_eos": True}
        reference = json.loads(post(url + "/v1/completions", body)[2])["choices"][0]["text"]
        request = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            lines = [response.readline()]
            serving = [asyncio.run(remote_stats("127.0.0.1", port))["sessions"] for port in ports[:2]]
            hung = targets[serving.index(1)]
            hung.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            lines += [line for line in response if line.strip()]
        waited = time.monotonic() - stopped_at
        chunks = [json.loads(line[6:]) for line in lines if line.startswith(b"data: ") and b"[DONE]" not in line]
        assert "".join(c["choices"][0]["text"] for c in chunks) == reference
        assert 10 <= waited < 60  # given up after STALLED_AFTER_S of silence, not at once, not never
        hung.send_signal(signal.SIGCONT)
        port = ports[targets.index(hung)]
        poll_until(lambda: asyncio.run(remote_stats("127.0.0.1", port))["sessions"], lambda n: n == 0, timeout=30)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        stop_processes(procs)


class _ScriptedUpstream:
    """Instances that each send what their script says: TOKENS, DONE, or a loss (RemoteError)."""

    def __init__(self, *scripts):
        self.targets, self.scripts, self.resumed = [object(), object()], list(scripts), []

    @contextlib.asynccontextmanager
    async def stream(self, prompt, params, priority, name, resumed=(), waits=None):
        self.resumed.append(resumed)
        events = iter(self.scripts.pop(0))

        class Stream:
            async def next(self):
                event = next(events)
                if isinstance(event, Exception):
                    raise event
                return event

        stream = Stream()
        yield stream, await stream.next()


@pytest.mark.parametrize("max_tokens", [3, 5])
async def test_a_choice_goes_on_from_its_tokens_and_one_whose_done_alone_was_lost_ends_by_length(max_tokens):
    from specctl.engine.tiny import make_byte_tokenizer
    from specctl.gateway.choices import Choices, ChoiceSpec
    from specctl.gateway.metrics import GatewayMetrics
    from specctl.net.protocol import Done, Tokens
    from specctl.verify.client import RemoteError

    lost = RemoteError("disconnected", "target instance a:1 closed the connection mid-stream")
    upstream = _ScriptedUpstream([Tokens(1, [104, 105]), Tokens(1, [33]), lost],
                                 [Tokens(2, [33, 33]), Done(2, "length", {"rounds": 1})])
    spec = ChoiceSpec(0, [1, 2], SamplingParams(max_tokens=max_tokens))
    tokenizer = make_byte_tokenizer()
    async with Choices(upstream, GatewayMetrics(), tokenizer, [spec], []) as choices:
        events = [event async for _, event in choices.events()]
    text = "".join(event.delta for event in events)
    if max_tokens == 3:  # all three came before the loss: nothing to go on with
        assert upstream.resumed == [()] and text == tokenizer.decode([104, 105, 33])
        assert events[-1].finish == "length" and events[-1].count == 3 and events[-1].stats == {}
    else:
        assert upstream.resumed == [(), (104, 105, 33)] and text == tokenizer.decode([104, 105, 33, 33, 33])
        assert events[-1].finish == "length" and events[-1].count == 5
        assert events[-1].stats == {"rounds": 1, "resumes": 1, "resumed_tokens": 3}  # the rounds: after the resume


async def test_a_choice_whose_done_alone_was_lost_still_ends_at_a_stop_its_last_unfinished_character_holds():
    from specctl.engine.tiny import make_byte_tokenizer
    from specctl.gateway.choices import Choices, ChoiceSpec
    from specctl.gateway.metrics import GatewayMetrics
    from specctl.net.protocol import Tokens
    from specctl.verify.client import RemoteError

    lost = RemoteError("disconnected", "target instance a:1 closed the connection mid-stream")
    tokenizer = make_byte_tokenizer()
    unfinished = tokenizer.encode("hi\u20ac", add_special_tokens=False)[:3]  # "hi" and the euro sign's first byte
    assert tokenizer.decode(unfinished) == "hi\ufffd"
    upstream = _ScriptedUpstream([Tokens(1, unfinished), lost])
    spec = ChoiceSpec(0, [1, 2], SamplingParams(max_tokens=3))
    async with Choices(upstream, GatewayMetrics(), tokenizer, [spec], ["\ufffd"]) as choices:
        events = [event async for _, event in choices.events()]
    assert upstream.resumed == [()]  # all three came: nothing to go on with
    assert "".join(event.delta for event in events) == "hi"
    # the count: up to the token that completed the stop (as a stop met mid-stream counts it)
    assert (events[-1].finish, events[-1].count, events[-1].stop_reason) == ("stop", 3, "\ufffd")
