"""A request's options drawn together by hypothesis (tests/test_combinations.py), through a target
instance with several drafters as separate processes: two draft servers (a chain and a tree,
one pre-speculating), the n-gram lookup and suffix decoding, fused each round, under a round
deadline the slower draft server misses now and then. A few requests at a time: each greedy
output is the target alone's; a seeded sample sent again, after other requests have filled
suffix decoding's memory and moved the deadline's choices, repeats its text. Then every server
holds no session and no KV."""

import asyncio
import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specctl.bench.processes import free_ports, spawn_role, stop_processes, wait_listening
from specctl.spec.params import SamplingParams
from specctl.verify.client import remote_stats
from tests.conftest import poll_async
from tests.test_combinations import SETTINGS, _options, _plain, _prompt, _run
from tests.test_star_combinations import COMMON, _run_all


@pytest.fixture(scope="module")
def fused(tiny_dir):
    chain_port, tree_port, target_port = free_ports(3)
    procs = []
    try:
        procs.append(spawn_role("draft", "--port", str(chain_port), "--model", str(tiny_dir["llama-draft"]),
                                "--mode", "chain", "--depth", "3", *COMMON))
        wait_listening(procs[0], "draft server")
        procs.append(spawn_role("draft", "--port", str(tree_port), "--model", str(tiny_dir["llama-draft"]),
                                "--mode", "tree", "--depth", "3", "--topk", "2", "--width", "3", "--prespec",
                                "--prespec-budget", "6", "--no-prespec-trials", *COMMON))
        wait_listening(procs[1], "draft server")
        procs.append(spawn_role("verify", "--model", str(tiny_dir["llama"]), "--draft", f"127.0.0.1:{chain_port}",
                                "--draft", f"127.0.0.1:{tree_port}", "--draft", "ngram", "--draft", "suffix",
                                "--draft-deadline-ms", "8", "--port", str(target_port), *COMMON))
        wait_listening(procs[2], "target instance")
        yield (chain_port, tree_port), target_port
    finally:
        stop_processes(procs)


@pytest.mark.slow  # processes and TCP: about a minute
@SETTINGS
@given(data=st.data())
def test_requests_with_drawn_options_through_several_drafters_equal_the_target_alone(fused, tiny, data):
    _, port = fused
    target = tiny["llama"]
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
    others = [(p, SamplingParams(max_tokens=12, temperature=1.0)) for p, _ in requests]  # new texts for suffix decoding
    again = asyncio.run(_run_all(port, [(prompt, seeded), *others]))[:1]
    assert first == again


@pytest.mark.slow
def test_several_drafters_hold_nothing_after_the_drawn_requests(fused):
    """Run after the drawn requests (the module's order): every session closed, its KV freed."""
    draft_ports, target_port = fused

    async def check():
        drafts = [await poll_async(lambda port=port: remote_stats("127.0.0.1", port), lambda s: s["sessions"] == 0)
                  for port in draft_ports]
        target = await poll_async(lambda: remote_stats("127.0.0.1", target_port), lambda s: s["sessions"] == 0)
        return drafts, target

    drafts, target = asyncio.run(check())
    assert all(draft["kv_used_mb"] == 0 and draft["rounds"] > 0 for draft in drafts)
    assert target["kv_used_mb"] == 0
