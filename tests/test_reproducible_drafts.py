"""A seeded sampled request repeats its text (SamplingParams.repeatable, DraftState.reproducible):
its draft computes every bit as a cold start alone would — no restored prefix (a bf16 draft's
restored KV has decode steps' bits, not a prefill's), never batched with other sessions, never
pre-speculated (Saguaro-reshaped, timed by leftover capacity) — so its sample does not depend
on what the draft server cached or did for others. Other requests keep all three."""

import asyncio

import pytest
import torch

from specctl.engine.kv_cache import KVPool
from specctl.engine.loader import load_decoder
from specctl.net.protocol import OpenSession
from specctl.spec.draft_state import DraftState, draft_capacity, draft_many
from specctl.spec.drafters import ModelChainDrafter
from specctl.spec.params import SamplingParams
from specctl.verify.draft_client import DraftClient
from tests.test_prespec import TREE, make_table, run
from tests.test_row_exact import _row_exact_target

SEEDED = SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True, seed=5)


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def bf16_draft(tiny_dir):
    draft = load_decoder(tiny_dir["llama"], dtype=torch.bfloat16, layer_range=(0, 2))  # agrees often: hits
    return draft.use_prefix_cache(8 << 20)


def test_seeded_and_sampled_is_what_asks_to_repeat():
    assert SEEDED.repeatable
    assert not SamplingParams(temperature=0.9).repeatable  # no seed: a fresh sample each time
    assert not SamplingParams(seed=5).repeatable  # greedy repeats anyway: the draft may use its savings


@pytest.mark.parametrize("tree", [None, TREE])
def test_a_seeded_sample_is_a_cold_start_s_whatever_the_draft_cached_or_pre_speculated(tiny_dir, bf16_draft, tree):
    target = _row_exact_target(tiny_dir, "bf16")  # its own restores are exact (test_row_exact_prefill)
    target.use_prefix_cache(8 << 20)
    prefixes = bf16_draft.prefix_cache
    prefixes.clear()
    table = make_table(bf16_draft, budget=6, saguaro_c=0.5, tree=tree)
    first = _prompt(1, 40)
    output = run(target, table, first, SEEDED, steps=8, tag=1, reproducible=True)[0]
    second = first + output + _prompt(2, 9)  # a chat's next turn: its start is in both caches
    hits = prefixes.stats.hits
    again = run(target, table, second, SEEDED, steps=8, tag=2, reproducible=True)[0]
    assert prefixes.stats.hits == hits  # the draft restored nothing
    snap = table.speculation.snapshot()
    assert snap["hits"] == snap["misses"] == 0 and table.speculation.plans == {}  # nor pre-speculated
    prefixes.clear()
    target.prefix_cache.clear()
    cold = make_table(bf16_draft, budget=6, tree=tree)  # a fresh draft server, both caches empty
    assert run(target, cold, second, SEEDED, steps=0, tag=3, reproducible=True)[0] == again
    # a session not marked (an unseeded request's; seeded here so that the count is fixed) keeps
    # both savings: the same turn restores the draft's prefix and is answered from branches
    # (not adaptive, every choice is the test's: misses drafted just in time, whatever the machine's speed)
    cool = SamplingParams(temperature=0.2, max_tokens=20, ignore_eos=True, seed=1)  # outcomes the branches hold
    run(target, table, second, cool, steps=8, tag=4, reproducible=False)
    assert prefixes.stats.hits == hits + 1
    assert table.speculation.snapshot()["hits"] > 0


def test_reproducible_sessions_are_drafted_alone_and_others_together(bf16_draft):
    """A bf16 product of one row may take another kernel than one of two (engine.rows): a session
    drafted with others could get other bits than alone. Chains of two sessions drafted in one
    call: each reproducible one's proposal is, to the bit, the one it gets drafted alone."""
    drafter = ModelChainDrafter(bf16_draft, 3)
    params = SamplingParams(temperature=0.9)

    def state(seed: int, reproducible: bool) -> DraftState:
        capacity = draft_capacity(30, 16, drafter.max_nodes)
        return DraftState(drafter.open(capacity, KVPool(None)), params, torch.Generator().manual_seed(seed),
                          _prompt(seed, 30), capacity, drafter.max_nodes, bf16_draft.spec.vocab_size,
                          reproducible=reproducible)

    def proposals(reproducible: bool, which: list[int]):
        states = [state(seed, reproducible) for seed in which]
        out = draft_many(states)
        for s in states:
            s.close()
        return [(p.tree.tokens.tolist(), p.draft_probs) for p in out]

    alone = [proposals(True, [seed])[0] for seed in (1, 2)]
    together = proposals(True, [1, 2])
    for (tokens, probs), (tokens_alone, probs_alone) in zip(together, alone):
        assert tokens == tokens_alone and torch.equal(probs, probs_alone)
    calls = []
    forward_many = bf16_draft.forward_many
    try:  # the others still share each step's forward
        bf16_draft.forward_many = lambda *args, **kw: calls.append(len(args[0])) or forward_many(*args, **kw)
        proposals(False, [1, 2])
        assert calls and set(calls) == {2}
        calls.clear()
        proposals(True, [1, 2])
        assert calls and set(calls) == {1}
    finally:
        del bf16_draft.forward_many


async def test_the_target_s_draft_client_marks_a_seeded_sample_and_the_draft_server_keeps_it(tiny_dir):
    """OpenSession.reproducible on the wire and the draft server's session state made so; an
    older peer's frame (no field) opens an ordinary session. (Which requests ask: below.)"""
    from specctl.draft.server import DraftServer, DraftServerConfig
    from specctl.engine.loader import load_model

    draft = load_model("tiny-llama@2", tiny_dir["llama"], "fp32", num_layers=2)
    server = DraftServer(draft, ModelChainDrafter(draft.decoder, 3), DraftServerConfig(port=0))
    client = DraftClient("127.0.0.1", await server.start(), model=draft.name, fingerprint=draft.vocab_fingerprint)
    first = asyncio.get_running_loop().create_future()
    link = asyncio.create_task(client.run(first))
    try:
        assert await first
        marks = []
        for reproducible in (True, False):
            handle = await client.open(_prompt(1, 12), temperature=0.9, top_p=1.0, top_k=0, seed=9, max_tokens=8,
                                       rules=SEEDED, reproducible=reproducible)
            marks.append(server.table.states[handle[1]].reproducible)
            client.close(handle)
        assert marks == [True, False]
    finally:
        link.cancel()
        await server.close()
    assert OpenSession(1, [1, 2]).reproducible is False


def test_a_target_asks_for_a_reproducible_draft_for_a_seeded_sample_only():
    """A seeded sampled request's draft session is reproducible (one of several drafters' too,
    since 2026-12-06: verify.fused repeats a seeded sample's text); an unseeded or greedy one's is not."""
    from specctl.verify.speculator import reproducible_draft

    assert reproducible_draft(SEEDED)
    assert not reproducible_draft(SamplingParams(temperature=0.9))
    assert not reproducible_draft(SamplingParams(seed=5))
