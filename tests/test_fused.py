"""A target instance with several draft servers and the local n-gram lookup (CoSine over TCP):
greedy output equals the target alone, a draft server killed mid-run changes nothing, sampled
sessions run, per-drafter stats, freed state."""

import asyncio
from types import SimpleNamespace

import pytest

from specctl.draft.server import DraftServer, DraftServerConfig
from specctl.engine.loader import load_model
from specctl.spec.suffix import SuffixDrafter
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter
from specctl.spec.params import SamplingParams
from specctl.spec.pays import SPEC_FIRST, probe_after
from specctl.spec.routing import RoutingPolicy
from specctl.verify.client import remote_generate
from specctl.verify.draft_client import DraftClient
from specctl.verify.fused import Fusion
from specctl.verify.server import TargetServer, TargetServerConfig
from tests.conftest import wait_until
from tests.test_star import PROMPTS, local_reference


@pytest.fixture(scope="module")
def models(tiny_dir):
    target = load_model("tiny-llama", tiny_dir["llama"], "fp32")
    drafts = [load_model("tiny-llama@2", tiny_dir["llama"], "fp32", num_layers=2),
              load_model("tiny-llama-draft", tiny_dir["llama-draft"], "fp32")]
    return target, drafts


async def _start(models, policy=None, deadline_s=2.0, modes=("chain", "chain"), ngram_depth=3, suffix=None):
    target, drafts = models
    servers, clients, links = [], {}, []
    for draft, mode in zip(drafts, modes):
        drafter = ModelTreeDrafter(draft.decoder, 3, 2, 4) if mode == "tree" else ModelChainDrafter(draft.decoder, 3)
        server = DraftServer(draft, drafter, DraftServerConfig(port=0))
        port = await server.start()
        client = DraftClient("127.0.0.1", port, model=target.name, fingerprint=target.vocab_fingerprint)
        first = asyncio.get_running_loop().create_future()
        links.append(asyncio.create_task(client.run(first)))
        assert await first
        servers.append(server)
        clients[f"127.0.0.1:{port}"] = client
    fusion = Fusion(clients, ngram_depth=ngram_depth, budget=8, deadline_s=deadline_s, policy=policy or RoutingPolicy(),
                    suffix=suffix)
    target_server = TargetServer(target, TargetServerConfig(port=0), None, fusion=fusion)
    port = await target_server.start()
    return servers, links, target_server, port, fusion


async def _stop(servers, links, target_server):
    for link in links:
        link.cancel()
    await target_server.close()
    for server in servers:
        await server.close()


@pytest.mark.parametrize("modes", [("chain", "chain"), ("tree", "chain")])
async def test_greedy_with_two_draft_servers_and_ngram_equals_the_target_alone(models, modes):
    servers, links, target_server, port, fusion = await _start(models, RoutingPolicy(tau=100.0, alpha=1.0, beta=1.0),
                                                               modes=modes)
    try:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        results = await asyncio.gather(*(remote_generate("127.0.0.1", port, p, params) for p in PROMPTS))
        for prompt, (tokens, reason, _) in zip(PROMPTS, results):
            assert tokens == local_reference(models, prompt, 24) and reason == "length"
        stats = target_server.snapshot()["drafters"]
        assert set(stats) == {*fusion.clients, "ngram", "none"}  # "none": the rounds routed to plain decoding
        assert sum(s["chosen_rounds"] for s in stats.values()) > 0 and all(s["connected"] for s in stats.values())
        first = stats[next(iter(fusion.clients))]  # a tree drafter's nodes are fused and credited too
        assert first["chosen_rounds"] > 0 and first["accepted_tokens"] > 0 and first["failures"] == 0
        # the sessions' KV is freed on the compute threads after their DONE: waited for (a leak times out)
        await wait_until(lambda: all(s.table.states == {} and s.table.pool.used_bytes == 0 for s in servers)
                         and target_server.active == 0 and target_server.pool.used_bytes == 0, what="every KV freed")
    finally:
        await _stop(servers, links, target_server)


async def test_local_suffix_decoding_draws_on_the_instances_earlier_outputs_and_frees_its_sessions(models):
    """`verify --draft suffix`: no draft server; the second run of each prompt is drafted from the
    first run's output (its text the target alone's), and the sessions' own texts are freed."""
    from specctl.spec.suffix import SuffixDrafter

    always = RoutingPolicy(tau=100.0, alpha=1.0, beta=1.0, plain_arm=False, by_rate=False)  # no timed choices
    fusion = Fusion({}, suffix=SuffixDrafter(4), budget=8, policy=always)
    target_server = TargetServer(models[0], TargetServerConfig(port=0), None, fusion=fusion)
    port = await target_server.start()
    try:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        first = await asyncio.gather(*(remote_generate("127.0.0.1", port, p, params) for p in PROMPTS))
        accepted_before = target_server.snapshot()["drafters"]["suffix"]["accepted_tokens"]
        again = await asyncio.gather(*(remote_generate("127.0.0.1", port, p, params) for p in PROMPTS))
        for prompt, (tokens, _, _), (repeated, _, stats) in zip(PROMPTS, first, again):
            assert tokens == repeated == local_reference(models, prompt, 24)
            assert stats["accepted"] >= 12, stats  # of 23 after the prefill's token: most drafted
        assert set(target_server.snapshot()["drafters"]) == {"suffix"}
        assert target_server.snapshot()["drafters"]["suffix"]["accepted_tokens"] >= accepted_before + 12 * len(PROMPTS)
        assert len(fusion.suffix.outputs.sequences) == 2 * len(PROMPTS)
        await wait_until(lambda: target_server.active == 0)
        # each whole output remembered (after its prompt's last token), the last round's too
        remembered = sorted(seq.tolist() for seq in fusion.suffix.outputs.sequences.values())
        assert remembered == sorted([p[-1], *tokens] for p, (tokens, _, _) in [*zip(PROMPTS, first), *zip(PROMPTS, again)])
        await wait_until(lambda: target_server.active == 0 and target_server.pool.used_bytes == 0,
                         what="every KV freed")
    finally:
        await target_server.close()


async def test_a_seeded_sample_repeats_its_text_whatever_other_requests_left_and_the_deadline(models):
    """Two draft servers, the n-gram lookup and suffix decoding behind one target, and a deadline no
    draft server meets: other requests fill suffix decoding's memory and bench the draft servers,
    yet a seeded sample repeats its text — it waits for the draft servers (none late for it, none
    benched for it), leaves suffix decoding out and has no measured-times gate. (Before 2026-12-06
    its rounds followed the memory and the deadline: the text changed.)"""
    servers, links, target_server, port, fusion = await _start(models, deadline_s=1e-4, suffix=SuffixDrafter(4))
    try:
        seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
        greedy = SamplingParams(max_tokens=24, ignore_eos=True)
        first = await remote_generate("127.0.0.1", port, PROMPTS[1], seeded)
        await asyncio.gather(*(remote_generate("127.0.0.1", port, p, params)
                               for p in PROMPTS for params in (greedy, SamplingParams(max_tokens=24, temperature=1.0))))
        assert all(fusion.benched(name) for name in fusion.clients)  # late for the unseeded, three rounds in a row
        assert len(fusion.suffix.outputs.sequences) > 1
        before = target_server.snapshot()["drafters"]
        again = await remote_generate("127.0.0.1", port, PROMPTS[1], seeded)
        after = target_server.snapshot()["drafters"]
        assert again[0] == first[0] and again[1] == "length"
        assert sum(after[name]["chosen_rounds"] - before[name]["chosen_rounds"] for name in fusion.clients) > 0
        assert all(after[name]["failures"] == before[name]["failures"] for name in fusion.clients)
        assert after["suffix"]["chosen_rounds"] == before["suffix"]["chosen_rounds"]
        await wait_until(lambda: all(s.table.states == {} for s in servers) and target_server.active == 0
                         and target_server.pool.used_bytes == 0, what="every KV freed")  # freed after the DONE
    finally:
        await _stop(servers, links, target_server)


async def test_a_draft_server_killed_mid_run_changes_nothing(models):
    servers, links, target_server, port, fusion = await _start(models, RoutingPolicy(tau=100.0, alpha=1.0, beta=1.0),
                                                               deadline_s=0.5)
    try:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        runs = [asyncio.create_task(remote_generate("127.0.0.1", port, p, params)) for p in PROMPTS]
        await wait_until(lambda: target_server.totals.rounds >= 6, what="a few rounds")
        await servers[0].close()
        results = await asyncio.gather(*runs)
        for prompt, (tokens, reason, _) in zip(PROMPTS, results):
            assert tokens == local_reference(models, prompt, 40) and reason == "length"
        sampled, reason, _ = await remote_generate("127.0.0.1", port, PROMPTS[1],
                                                   SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=4))
        assert len(sampled) == 16 and reason == "length"
    finally:
        await _stop(servers, links, target_server)


@pytest.mark.parametrize("by_rate", [True, False])
async def test_a_slow_draft_server_leads_only_the_rounds_that_measure_it(models, by_rate):
    one_a_round = RoutingPolicy(alpha=0.0, beta=0.0, free_riders=False, plain_arm=False, by_rate=by_rate)
    servers, links, target_server, port, fusion = await _start(models, one_a_round, ngram_depth=0)
    slow_name, fast_name = fusion.clients
    slow, propose = fusion.clients[slow_name], fusion.clients[slow_name].propose

    async def slowed(*args, **kwargs):  # the better drafter (the target's own first layers), 0.3 s late
        await asyncio.sleep(0.3)
        return await propose(*args, **kwargs)

    slow.propose = slowed
    try:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        tokens, reason, _ = await remote_generate("127.0.0.1", port, PROMPTS[0], params)
        assert tokens == local_reference(models, PROMPTS[0], 40) and reason == "length"
        stats = target_server.snapshot()["drafters"]
        led = stats[slow_name]["chosen_rounds"], stats[fast_name]["chosen_rounds"]
        if by_rate:  # first by rank (the session's first round and 2 measured), then once per probe
            probes, judged_on, between = 0, SPEC_FIRST, probe_after(SPEC_FIRST)
            while between <= led[1]:  # the probes come further apart as it is judged on more rounds
                probes, judged_on = probes + 1, judged_on + 1
                between += probe_after(judged_on)
            assert led[0] <= 3 + probes and led[1] > 3 * led[0]
            # what the session measured is the target's: the next session starts from it (spec.pays)
            assert sorted(fusion.pooled_rounds) == [0, 1]
            assert all(seconds > 0 for rounds in fusion.pooled_rounds.values() for _, (_, seconds) in rounds)
            tokens, _, _ = await remote_generate("127.0.0.1", port, PROMPTS[0], params)
            assert tokens == local_reference(models, PROMPTS[0], 40)
            again = target_server.snapshot()["drafters"][slow_name]["chosen_rounds"] - led[0]
            assert again < led[0]  # no trial rounds: only the runner-up's probes
        else:  # the score alone never sees that it is slow
            assert led[0] > led[1]
    finally:
        await _stop(servers, links, target_server)


async def test_a_draft_server_always_past_the_deadline_sits_rounds_out(models, caplog):
    """A drafter slower than the deadline held every round it joined until the deadline, for
    nothing: late three rounds in a row, it sits out BENCH_S (said once in the log), the output
    unchanged; the stats say so."""
    from specctl.verify import fused as fused_module

    always_both = RoutingPolicy(alpha=1.0, beta=1.0, free_riders=False, plain_arm=False, by_rate=False)
    servers, links, target_server, port, fusion = await _start(models, always_both, deadline_s=0.1, ngram_depth=0)
    slow_name, fast_name = fusion.clients
    slow, propose = fusion.clients[slow_name], fusion.clients[slow_name].propose

    async def slowed(*args, **kwargs):  # always 0.25 s: past the 0.1 s deadline
        await asyncio.sleep(0.25)
        return await propose(*args, **kwargs)

    slow.propose = slowed
    try:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        sessions = 0
        # each session asks it in its first round at least; benched for the instance, not the session
        while not fusion.benched(slow_name) and sessions < 10:
            prompt = PROMPTS[sessions % len(PROMPTS)]
            tokens, reason, _ = await remote_generate("127.0.0.1", port, prompt, params)
            assert tokens == local_reference(models, prompt, 40) and reason == "length"
            sessions += 1
        before = target_server.snapshot()["drafters"]
        tokens, _, _ = await remote_generate("127.0.0.1", port, PROMPTS[0], params)  # without it
        assert tokens == local_reference(models, PROMPTS[0], 40)
        stats = target_server.snapshot()["drafters"]
        assert stats[fast_name]["chosen_rounds"] > before[fast_name]["chosen_rounds"]  # the other one drafted
        assert stats[slow_name]["failures"] == fused_module.LATE_IN_A_ROW
        assert stats[slow_name]["benched"] is True and stats[fast_name]["benched"] is False
        said = [r.getMessage() for r in caplog.records if "sits out" in r.getMessage()]
        assert said == [f"draft server {slow_name} answered past the 100 ms deadline 3 rounds in a row: it sits out, "
                        "tried again every 30 s (raise --draft-deadline-ms if it is merely slow)"]
    finally:
        await _stop(servers, links, target_server)


def test_a_benched_draft_server_is_tried_again_and_back_at_its_first_answer_in_time(monkeypatch):
    from specctl.verify import fused as fused_module

    clock = [100.0]
    monkeypatch.setattr(fused_module.time, "monotonic", lambda: clock[0])
    fusion = Fusion({})
    for _ in range(2):
        fusion.answered("a:1", late=True)
    assert not fusion.benched("a:1")  # two in a row: a hiccup
    fusion.answered("a:1", late=False)
    for _ in range(3):
        fusion.answered("a:1", late=True)
    assert fusion.benched("a:1")
    clock[0] += fused_module.BENCH_S + 1
    assert not fusion.benched("a:1")  # its trial round
    fusion.answered("a:1", late=True)  # late again: straight back out
    assert fusion.benched("a:1")
    clock[0] += fused_module.BENCH_S + 1
    fusion.answered("a:1", late=False)  # in time: back for good
    fusion.answered("a:1", late=True)
    assert not fusion.benched("a:1")


async def test_a_fused_round_with_predicted_rounds_after_it_is_not_measured():
    """A request's prediction drafted the rounds between this round and the next the fusion
    proposes (it passes their outcome): the time since is theirs too, so the gate leaves it out."""
    speculator = Fusion({}, ngram_depth=3, budget=8).speculator(0)
    session = SimpleNamespace(params=SamplingParams(), seq=[1, 2, 3, 1, 2], last_path=[], last_committed=[])
    speculator.begin(session)
    measured = lambda: sum(len(rounds) for rounds in speculator.gate.measured.values())  # noqa: E731
    await speculator.propose(session)  # the session's first round: its prompt prefill, not measured
    for committed, outcome in (([3], None), ([1], None), ([2, 3], ([], [2, 3])), ([1], None)):
        session.seq += committed
        session.last_committed = committed
        await speculator.propose(session, outcome)
    # ends: the first (unmeasured), two measured, the one predicted rounds followed (unmeasured)
    assert measured() == 2


def test_fusion_settings_are_checked():
    with pytest.raises(ValueError, match="budget must be >= 1 and the deadline > 0"):
        Fusion({}, ngram_depth=3, budget=0)


# 23-31 s each on a slow 2-core machine: both in --runslow (CI's second pass); the fusion itself is tested in-process above
@pytest.mark.slow
@pytest.mark.parametrize("routing", [(), ("--lead-by-score", "--no-plain-rounds", "--own-rates")])
def test_verify_with_two_drafts_from_the_command_line_equals_the_target_alone(tiny_dir, routing):
    import json

    from specctl.bench.processes import (
        free_ports,
        spawn_role,
        stop_processes,
        wait_listening,
    )
    from tests.test_cli import run

    draft_port, target_port = free_ports(2)
    common = ("--dtype", "fp32", "--threads", "1", "--log-level", "warning")
    procs = [spawn_role("draft", "--model", str(tiny_dir["llama-draft"]), "--port", str(draft_port), *common)]
    try:
        wait_listening(procs[0], "draft server")
        procs.append(spawn_role("verify", "--model", str(tiny_dir["llama"]), "--port", str(target_port),
                                "--draft", f"127.0.0.1:{draft_port}", "--draft", "ngram", *routing, *common))
        wait_listening(procs[1], "target instance")
        remote = run("generate", "--remote", f"127.0.0.1:{target_port}", "-p", "hello hello hello", "-n", "16",
                     "--json")
        local = run("generate", "--target", str(tiny_dir["llama"]), "--mode", "ar", "-p", "hello hello hello",
                    "-n", "16", "--dtype", "fp32", "--json")
        assert remote.returncode == 0 and local.returncode == 0, remote.stderr + local.stderr
        assert json.loads(remote.stdout)["token_ids"] == json.loads(local.stdout)["token_ids"]
    finally:
        stop_processes(procs)


async def test_a_fused_n_gram_lookup_keeps_to_the_round_s_max_depth():
    """The target's load asks for shorter proposals: the n-gram lookup looks for at most that many."""
    speculator = Fusion({}, ngram_depth=3, budget=8).speculator(0)
    session = SimpleNamespace(params=SamplingParams(),
                              seq=[1, 2, 3, 4, 5, 1, 2, 1, 2], last_path=[], last_committed=[])
    speculator.begin(session)
    full = await speculator.propose(session)
    assert list(full.proposal.tree.tokens) == [2, 3, 4, 5]
    capped = await speculator.propose(session, ([], []), max_depth=2)  # (nothing committed between)
    assert list(capped.proposal.tree.tokens) == [2, 1, 2]


async def test_a_fused_suffix_draft_keeps_to_the_round_s_max_depth():
    """As the n-gram lookup: the local suffix decoding drafts at most the round's cap deep."""
    speculator = Fusion({}, suffix=SuffixDrafter(8, max_spec_factor=4.0), budget=8).speculator(0)
    session = SimpleNamespace(params=SamplingParams(),
                              seq=[5, 6, 7, 8, 9, 10, 11, 5, 6], last_path=[], last_committed=[])
    speculator.begin(session)
    full = await speculator.propose(session)
    assert list(full.proposal.tree.tokens) == [6, 7, 8, 9, 10, 11, 5, 6]
    capped = await speculator.propose(session, ([], []), max_depth=2)
    assert list(capped.proposal.tree.tokens) == [6, 7, 8]
