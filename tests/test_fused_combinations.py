"""A request's options drawn together by hypothesis (tests/test_combinations.py), through a target
instance with several drafters as separate processes: two draft servers (a chain and a tree,
one pre-speculating), the n-gram lookup and suffix decoding, fused each round, under an 8 ms
round deadline (a draft server late for it sits that round out, unless the request is seeded). A few requests at a time: each greedy
output is the target alone's; a seeded sample sent again, after other requests have filled
suffix decoding's memory, repeats its text. Then every server
holds no session and no KV."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specctl.bench.processes import free_ports, spawn_role, stop_processes, wait_listening
from tests.test_combinations import SETTINGS
from tests.test_star_combinations import COMMON, check_drawn_requests, check_nothing_held


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
    check_drawn_requests(fused[1], tiny["llama"], data)


@pytest.mark.slow
def test_several_drafters_hold_nothing_after_the_drawn_requests(fused):
    """Run after the drawn requests (the module's order): every session closed, its KV freed."""
    draft_ports, target_port = fused
    assert check_nothing_held(list(draft_ports), target_port)[1]["prespec"]["steps"] > 0  # the tree pre-speculated
