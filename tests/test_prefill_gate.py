"""engine.prefill_gate: sessions that start alike at the same time prefill their start once —
the gate's decision, its release however a prefill ends, and over the star, where a request's
two choices with a long prompt each prefilled it (chunks interleaved) before."""

import asyncio

import pytest
import torch

from specctl.draft.server import DraftServer, DraftServerConfig
from specctl.engine.loader import load_model
from specctl.engine.prefill_gate import PrefillGate, prefill_gate
from specctl.engine.prefix_cache import PrefixCache
from specctl.spec.drafters import ModelChainDrafter
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate
from specctl.verify.client import remote_generate
from specctl.verify.draft_client import DraftClient
from specctl.verify.server import TargetServer, TargetServerConfig

PROMPT = list(range(5, 69))  # 64 tokens: 8 chunks of 8


def _store(decoder, prefixes: PrefixCache, tokens: list[int]) -> None:
    cache = decoder.new_cache(len(tokens) + 8)
    decoder(torch.tensor(tokens), torch.arange(len(tokens)), cache)
    prefixes.store(tokens, cache)


async def test_a_prompt_waits_for_a_prefill_in_flight_that_starts_the_same_way(tiny):
    gate = PrefillGate(PrefixCache(64 << 20))
    assert gate.sharer(PROMPT) is None  # nothing in flight
    with gate.prefilling(PROMPT):
        done = gate.sharer(PROMPT)
        assert isinstance(done, asyncio.Event) and not done.is_set() and gate.in_flight == 1
        assert gate.sharer(PROMPT[:40] + [200] * 24) is done  # 40 of 64 shared: more than half
        assert gate.sharer(PROMPT[:20] + [200] * 44) is None  # 20 of 64: not worth the wait
        assert gate.sharer(PROMPT[:10] + [200] * 6) is None  # 10: below the prefix cache's minimum
        assert gate.sharer([200] + PROMPT[1:]) is None  # another start
        assert gate.sharer(PROMPT[:32]) is done  # all 31 shared, the prefill in flight twice as long
        assert gate.sharer(PROMPT[:31]) is None  # ... but not more than twice: it would outlast this one's own
    assert done.is_set() and gate.in_flight == 0 and gate.sharer(PROMPT) is None


async def test_a_prefill_of_another_salt_is_not_waited_for():
    gate = PrefillGate(PrefixCache(64 << 20))
    with gate.prefilling(PROMPT, "tenant-a"):
        assert gate.sharer(PROMPT) is None and gate.sharer(PROMPT, "tenant-b") is None  # its KV would not serve them
        assert gate.sharer(PROMPT, "tenant-a") is not None


async def test_a_prompt_the_cache_holds_already_does_not_wait(tiny):
    prefixes = PrefixCache(64 << 20)
    _store(tiny["llama"], prefixes, PROMPT[:48])
    gate = PrefillGate(prefixes)
    with gate.prefilling(PROMPT):
        assert gate.sharer(PROMPT[:48] + [200] * 16) is None  # the 48 shared are cached: nothing to gain
        assert gate.sharer(PROMPT + [7]) is not None  # 16 more than the cache holds, all of what is left


async def test_a_failed_prefill_lets_its_waiters_go_and_the_next_waits_for_the_one_after():
    gate = PrefillGate(PrefixCache(64 << 20))
    order = []

    async def prefill(name, fail=False):
        async with gate.turn(PROMPT):
            order.append(f"{name} starts")
            await asyncio.sleep(0.01)
            if fail:
                raise RuntimeError("injected prefill failure")
            order.append(f"{name} ends")

    first = asyncio.create_task(prefill("first", fail=True))
    await asyncio.sleep(0)
    second, third = asyncio.create_task(prefill("second")), asyncio.create_task(prefill("third"))
    with pytest.raises(RuntimeError, match="injected prefill failure"):
        await first
    await asyncio.gather(second, third)
    # nothing was stored, so the second prefills it all, and the third waits for the second
    assert order == ["first starts", "second starts", "second ends", "third starts", "third ends"]
    assert gate.waits == 2 and gate.in_flight == 0


def test_a_decoder_without_a_prefix_cache_has_no_gate(tiny):
    assert prefill_gate(tiny["llama"]) is None


@pytest.fixture
def models(tiny_dir):
    """The tiny target and its 2-layer draft, each with a prefix cache and 8-token chunks."""
    target = load_model("tiny-llama", tiny_dir["llama"], "fp32")
    draft = load_model("tiny-llama@2", tiny_dir["llama"], "fp32", num_layers=2)
    for model in (target, draft):
        model.decoder.use_prefix_cache(64 << 20)
        model.decoder.prefill_chunk = 8
    return target, draft


async def _star(target, draft):
    draft_server = DraftServer(draft, ModelChainDrafter(draft.decoder, 3), DraftServerConfig(port=0))
    draft_port = await draft_server.start()
    client = DraftClient("127.0.0.1", draft_port, model=target.name, fingerprint=target.vocab_fingerprint)
    first = asyncio.get_running_loop().create_future()
    link = asyncio.create_task(client.run(first))
    assert await first
    target_server = TargetServer(target, TargetServerConfig(port=0), client)
    return draft_server, link, target_server, await target_server.start()


async def _together(port, prompt, params, servers, gates):
    """The sessions of ``params`` started at once on cold caches: (outputs, cached prompt
    tokens of each, the draft cache's tokens served)."""
    draft_server, target_server = servers
    while target_server.active or draft_server.table.states:  # the last sessions' closes store texts
        await asyncio.sleep(0.01)
    for server in servers:
        await server.compute.run(lambda: None)  # ... on the compute threads: done once this job runs
        server.model.decoder.prefix_cache.clear()
        server.prefill_gate = PrefillGate(server.model.decoder.prefix_cache) if gates else None
    served = draft_server.model.decoder.prefix_cache.snapshot()["hit_tokens"]
    results = await asyncio.gather(*(remote_generate("127.0.0.1", port, prompt, p) for p in params))
    return ([tokens for tokens, _, _ in results], [stats["cached_prompt_tokens"] for _, _, stats in results],
            draft_server.model.decoder.prefix_cache.snapshot()["hit_tokens"] - served)


async def test_two_choices_of_a_long_prompt_prefill_it_once_on_each_side(models):
    """Two sessions of one 64-token prompt started together (a request's n = 2): with the gates
    the second waits for the first's chunks and restores all but the prompt's last token on the
    target, and what the first fed before its first proposal (all but the last 8) on the draft;
    without them each computes it all. The outputs are the same either way: greedy, the target
    alone's; sampled with two seeds, the same texts with and without the gates (the draft's
    sessions of a seeded sample share nothing there: test_reproducible_drafts)."""
    target, draft = models
    draft_server, link, target_server, port = await _star(target, draft)
    servers = (draft_server, target_server)
    try:
        greedy = SamplingParams(max_tokens=16, ignore_eos=True)
        sampled = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=seed) for seed in (5, 6)]
        for params in ([greedy, greedy], sampled):
            shared, cached, served = await _together(port, PROMPT, params, servers, gates=True)
            # a seeded sample's draft session restores nothing (DraftState.reproducible): each feeds it all
            drafts_share = params[0].greedy
            assert (sorted(cached), served) == ([0, len(PROMPT) - 1], len(PROMPT) - 8 if drafts_share else 0)
            assert (target_server.prefill_gate.waits, draft_server.prefill_gate.waits) == (1, int(drafts_share))
            assert target_server.snapshot()["shared_prefills"] == 1
            assert draft_server.snapshot()["shared_prefills"] == int(drafts_share)
            alone, cached, served = await _together(port, PROMPT, params, servers, gates=False)
            assert (cached, served) == ([0, 0], 0)  # each computed it all
            assert shared == alone
            if params[0].greedy:
                target.decoder.prefix_cache, prefixes = None, target.decoder.prefix_cache
                try:
                    assert shared == [generate(target.decoder, PROMPT, greedy)[0]] * 2
                finally:
                    target.decoder.prefix_cache = prefixes
    finally:
        link.cancel()
        await target_server.close()
        await draft_server.close()


async def test_a_prefill_registered_on_another_event_loop_is_not_waited_for():
    import threading

    gate = PrefillGate(PrefixCache(64 << 20))
    registered, release = threading.Event(), threading.Event()

    async def elsewhere() -> bool:
        with gate.prefilling(PROMPT):
            registered.set()
            seen = gate.sharer(PROMPT) is not None  # its own loop waits for it
            await asyncio.to_thread(release.wait)
            return seen

    other = asyncio.create_task(asyncio.to_thread(asyncio.run, elsewhere()))
    await asyncio.to_thread(registered.wait)
    assert gate.in_flight == 1 and gate.sharer(PROMPT) is None  # an Event of another loop cannot be awaited here
    release.set()
    assert await other and gate.in_flight == 0


async def test_instances_over_one_model_share_its_gate_and_prefill_a_prompt_once(models):
    """Two target instances over one model (an embedded cluster's): one gate, so sessions of one
    prompt started together on each prefill it once; outputs the same."""
    from specctl.runtime.compute import ComputeThread

    target, _ = models
    target.decoder.prefix_cache.clear()
    compute = ComputeThread("test", max_batch=4)
    servers = [TargetServer(target, TargetServerConfig(port=0), None, compute=compute.lane(max_batch=4))
               for _ in range(2)]
    assert servers[0].prefill_gate is servers[1].prefill_gate is prefill_gate(target.decoder) is not None
    waits = servers[0].prefill_gate.waits
    ports = [await server.start() for server in servers]
    try:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        results = await asyncio.gather(*(remote_generate("127.0.0.1", port, PROMPT, params) for port in ports))
        assert sorted(stats["cached_prompt_tokens"] for _, _, stats in results) == [0, len(PROMPT) - 1]
        assert results[0][0] == results[1][0] and servers[1].prefill_gate.waits == waits + 1
    finally:
        for server in servers:
            await server.close()
        compute.stop()
