"""A request's options drawn together by hypothesis (tests/test_combinations.py), through the
star as separate processes: a pre-speculating tree draft server and a target instance, both
with prefix caches and chunked prefills. A few requests at a time, so the target verifies them
in one batch with their own rules and the draft server drafts them together (the rules followed
by the draft too): each greedy output is the target alone's; a seeded sample sent twice (the
second time over both servers' cached prefixes, beside other sampled requests) repeats its text. Then both servers hold no
session and no KV."""

import asyncio
import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specctl.bench.processes import free_ports, spawn_role, stop_processes, wait_listening
from specctl.spec.params import SamplingParams
from specctl.verify.client import RemoteError, remote_generate, remote_stats
from tests.conftest import poll_async
from tests.test_combinations import SETTINGS, _options, _plain, _prompt, _run

COMMON = ("--dtype", "fp32", "--threads", "1", "--log-level", "warning", "--prefix-cache-mb", "16",
          "--prefill-chunk", "16")


@pytest.fixture(scope="module")
def star(tiny_dir):
    draft_port, target_port = free_ports(2)
    procs = []
    try:
        procs.append(spawn_role("draft", "--port", str(draft_port), "--model", str(tiny_dir["llama-draft"]),
                                "--mode", "tree", "--depth", "3", "--topk", "2", "--width", "3", "--prespec",
                                "--prespec-budget", "6", "--no-prespec-trials", *COMMON))
        wait_listening(procs[0], "draft server")
        # a verification a little slower than drafting leaves the draft time to pre-speculate
        procs.append(spawn_role("verify", "--model", str(tiny_dir["llama"]), "--draft", f"127.0.0.1:{draft_port}",
                                "--port", str(target_port), "--verify-delay-ms", "15", *COMMON))
        wait_listening(procs[1], "target instance")
        yield draft_port, target_port
    finally:
        stop_processes(procs)


async def _run_all(port: int, requests: list[tuple[list[int], SamplingParams]]) -> list[tuple[list[int], str] | str]:
    """Each request's (tokens, finish_reason), or the message of the error it ended with."""
    results = await asyncio.gather(*(remote_generate("127.0.0.1", port, prompt, params) for prompt, params in requests),
                                   return_exceptions=True)
    return [str(result) if isinstance(result, RemoteError) else result[:2] for result in results]


def check_drawn_requests(port: int, target, data) -> None:
    """1-3 requests of drawn options at once: each ends as the target alone ends it; then the first
    one's prompt and options as a seeded sample, sent again beside sampled requests of the other
    prompts (the servers' caches, batches and memories moved meanwhile), repeats its text."""
    requests = []
    for _ in range(data.draw(st.integers(1, 3))):
        prompt = _prompt(data)
        requests.append((prompt, _options(data, _plain(target, prompt))))
    expected = [f"generation failed: {session}" if isinstance(session, str) else
                (session.output, session.finish_reason) for session in (_run(target, p, q) for p, q in requests)]
    assert asyncio.run(_run_all(port, requests)) == expected

    prompt, options = requests[0]
    seeded = dataclasses.replace(options, temperature=data.draw(st.sampled_from([0.6, 1.2])),
                                 seed=data.draw(st.integers(0, 9)))
    first = asyncio.run(_run_all(port, [(prompt, seeded)]))
    others = [(p, SamplingParams(max_tokens=12, temperature=1.0)) for p, _ in requests]
    assert asyncio.run(_run_all(port, [(prompt, seeded), *others]))[:1] == first


@pytest.mark.slow  # processes and TCP: about a minute
@SETTINGS
@given(data=st.data())
def test_requests_with_drawn_options_through_a_pre_speculating_star_equal_the_target_alone(star, tiny, data):
    check_drawn_requests(star[1], tiny["llama"], data)


def check_nothing_held(draft_ports: list[int], target_port: int) -> list[dict]:
    """Every server ends with no session and no KV, each draft server having drafted; the draft
    servers' stats."""
    async def idle(port: int) -> dict:
        return await poll_async(lambda: remote_stats("127.0.0.1", port), lambda s: s["sessions"] == 0)

    drafts = [asyncio.run(idle(port)) for port in draft_ports]
    assert all(draft["kv_used_mb"] == 0 and draft["rounds"] > 0 for draft in drafts)
    assert asyncio.run(idle(target_port))["kv_used_mb"] == 0
    return drafts


@pytest.mark.slow
def test_the_star_holds_nothing_after_the_drawn_requests(star):
    """Run after the drawn requests (the module's order): every session closed, its KV freed."""
    draft_port, target_port = star
    assert check_nothing_held([draft_port], target_port)[0]["prespec"]["steps"] > 0
