"""Many sessions in one forward: the ragged batched forward, batched chain drafting, and
the compute thread's batching of queued requests."""

import asyncio
import threading
import time

import pytest
import torch

from specctl.runtime.compute import ComputeThread
from specctl.runtime.emulation import SlowedLane
from specctl.spec.batch_drafting import propose_chains
from specctl.spec.drafters import ModelChainDrafter
from specctl.spec.params import SamplingParams
from specctl.verify.server import TargetServerConfig
from tests.conftest import verify_together_to_the_end, wait_until


def test_forward_many_equals_one_session_at_a_time(tiny):
    decoder = tiny["llama"]
    prompts = [[1, 2, 3, 4, 5], [9, 8], [40, 41, 42]]
    new = [[6, 7], [7], [43, 44, 45]]
    singles, batched_caches = [], []
    for prompt, extra in zip(prompts, new):
        cache = decoder.new_cache(16)
        decoder(torch.tensor(prompt), torch.arange(len(prompt)), cache)
        singles.append(decoder(torch.tensor(extra), torch.arange(len(prompt), len(prompt) + len(extra)), cache))
        other = decoder.new_cache(16)
        decoder(torch.tensor(prompt), torch.arange(len(prompt)), other)
        batched_caches.append(other)
    out = decoder.forward_many(
        [torch.tensor(e) for e in new],
        [torch.arange(len(p), len(p) + len(e)) for p, e in zip(prompts, new)],
        batched_caches, [None] * 3, [torch.arange(len(e)) for e in new],
    )
    for single, batched in zip(singles, out):
        torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-5)
    assert [c.length for c in batched_caches] == [7, 3, 6]


def test_batched_chain_drafting_matches_one_at_a_time(tiny):
    drafter = ModelChainDrafter(tiny["llama-self2"], 4)
    seqs = [[1, 2, 3, 4], [50, 60], [7, 7, 7, 7, 7, 7]]
    greedy = SamplingParams()
    alone = [drafter.open(32).propose(s, greedy, None).tree.tokens.tolist() for s in seqs]
    sessions = [drafter.open(32) for s in seqs]
    together = propose_chains(sessions, seqs, [greedy] * 3, [None] * 3)
    assert [p.tree.tokens.tolist() for p in together] == alone
    assert [s.cache.length for s in sessions] == [len(s) + 3 for s in seqs]


def test_a_greedy_chain_read_back_once_equals_one_read_back_a_step(tiny):
    """With no adaptive depth a greedy chain feeds each token to the next step on the device
    and reads the chain back once; a stop too small to end any chain (1e-30) takes the
    read-back-a-step path. Both draft the same tokens, probabilities, candidates and KV."""
    seqs = [[1, 2, 3, 4], [50, 60], [7, 7, 7, 7, 7, 7]]
    greedy = SamplingParams()
    proposals, caches = {}, {}
    for stop in (0.0, 1e-30):
        drafter = ModelChainDrafter(tiny["llama-draft"], 4, stop=stop)
        sessions = [drafter.open(32) for _ in seqs]
        proposals[stop] = propose_chains(sessions, seqs, [greedy] * 3, [None] * 3)
        caches[stop] = [s.cache.k[..., : s.cache.length, :].clone() for s in sessions]
    for once, per_step in zip(proposals[0.0], proposals[1e-30]):
        assert once.tree.tokens.tolist() == per_step.tree.tokens.tolist()
        assert once.tree.score.tolist() == per_step.tree.score.tolist()
        assert torch.equal(once.ranked, per_step.ranked)
        assert once.draft_probs is None and per_step.draft_probs is None
    for once, per_step in zip(caches[0.0], caches[1e-30]):
        assert torch.equal(once, per_step)


async def test_compute_thread_serves_queued_requests_in_one_pass():
    compute = ComputeThread("test", max_batch=8).lane(owns_thread=True)
    gate, busy = threading.Event(), threading.Event()
    try:
        blocker = asyncio.ensure_future(compute.run(lambda: busy.set() or gate.wait()))
        await asyncio.to_thread(busy.wait)
        calls = []

        def batch_fn(items):
            calls.append(list(items))
            return [ValueError("bad item") if item == 3 else item * 10 for item in items]

        pending = [asyncio.ensure_future(compute.run_batched("k", batch_fn, i)) for i in range(5)]
        await wait_until(lambda: compute.queue_depth == 5, what="five jobs queued")
        gate.set()
        await blocker
        results = await asyncio.gather(*pending, return_exceptions=True)
        assert calls == [[0, 1, 2, 3, 4]]
        assert results[:3] == [0, 10, 20] and results[4] == 40
        assert isinstance(results[3], ValueError) and str(results[3]) == "bad item"
        assert compute.stats.jobs == 6 and compute.stats.passes == 2
    finally:
        compute.stop()


async def test_background_work_runs_only_between_jobs_and_delays_a_job_one_step_at_most():
    compute = ComputeThread("test", max_batch=8).lane(owns_thread=True)
    steps, stepping = [], threading.Event()

    def background() -> bool:  # never runs out of work, like pre-speculation under load
        stepping.set()
        steps.append(threading.current_thread().name)
        time.sleep(0.01)
        return len(steps) < 10_000

    try:
        compute.add_background(background)
        assert not steps  # not woken yet: nothing runs
        compute.wake_background()
        await asyncio.to_thread(stepping.wait)
        for i in range(20):  # jobs arriving while it is busy are still served, each promptly
            assert await compute.run(lambda i=i: i * 2) == i * 2
        snap = compute.stats.snapshot(0)
        assert snap["background_steps"] > 0 and snap["jobs"] == 20
        # Each job waited for the step under way, never for a second one.
        assert compute.stats.background_delay_max_s <= compute.stats.background_step_max_s
        assert set(steps) == {"test"}
    finally:
        compute.stop()


async def test_background_work_stops_when_it_has_nothing_to_do():
    compute = ComputeThread("test").lane(owns_thread=True)
    calls = []
    try:
        compute.add_background(lambda: calls.append(1) and False)
        compute.wake_background()
        await wait_until(lambda: calls, what="one background call")
        await asyncio.sleep(0.1)
        assert len(calls) == 1  # it said there was nothing to do: not called again until woken
        compute.wake_background()
        await wait_until(lambda: len(calls) == 2, what="a second call after waking")
    finally:
        compute.stop()


async def test_lanes_share_one_thread_but_not_batches_or_stats():
    thread = ComputeThread("shared", max_batch=8)
    draft, target = thread.lane(), thread.lane(max_batch=2)
    gate, busy = threading.Event(), threading.Event()
    try:
        blocker = asyncio.ensure_future(draft.run(lambda: busy.set() or gate.wait()))
        await asyncio.to_thread(busy.wait)
        calls = []

        def batch_fn(items):
            calls.append(list(items))
            return list(items)

        pending = [asyncio.ensure_future(lane.run_batched("k", batch_fn, (name, i)))
                   for i in range(3) for lane, name in ((draft, "d"), (target, "t"))]
        await wait_until(lambda: draft.queue_depth == 3 and target.queue_depth == 3, what="six jobs queued")
        gate.set()
        await blocker
        await asyncio.gather(*pending)
        # Same key, different lanes: never in one batch; the target lane's limit is 2.
        assert calls == [[("d", 0), ("d", 1), ("d", 2)], [("t", 0), ("t", 1)], [("t", 2)]]
        assert (draft.stats.jobs, draft.stats.passes) == (4, 2)
        assert (target.stats.jobs, target.stats.passes) == (3, 2)
        draft.stop()  # a lane that does not own the thread leaves it running
        assert await target.run(lambda: "still serving") == "still serving"
    finally:
        thread.stop()


@pytest.mark.parametrize("shared", [False, True])
async def test_a_thread_roles_share_waits_for_a_pass_s_follow_ups_and_serves_them_with_the_queued(shared):
    """Two sessions' proposals in one pass; their verifications reach the queue 20 and 30 ms
    later (the loop hands them over), after a third session's. Work-conserving, the third is
    served alone and the two fall out of step with it; a thread roles share
    (share_between_roles) waits for the pass's two follow-ups and serves all three at once."""
    thread = ComputeThread("test", max_batch=8)
    if shared:
        thread.share_between_roles(0.5)  # ends once the two follow-ups are in, long before
    draft, target = thread.lane(), thread.lane()
    calls = []

    def batch_fn(items):
        calls.append(list(items))
        return list(items)

    async def session(name: str, late_s: float) -> str:
        await draft.run_batched("propose", batch_fn, name)
        await asyncio.sleep(late_s)
        return await target.run_batched("verify", batch_fn, name)

    gate, busy = threading.Event(), threading.Event()
    try:
        blocker = asyncio.ensure_future(target.run(lambda: busy.set() or gate.wait()))
        await asyncio.to_thread(busy.wait)
        sessions = [asyncio.ensure_future(session("a", 0.02)), asyncio.ensure_future(session("b", 0.03))]
        await wait_until(lambda: thread.queue_depth == 2, what="two proposals queued")
        third = asyncio.ensure_future(target.run_batched("verify", batch_fn, "c"))
        await wait_until(lambda: thread.queue_depth == 3, what="a third session's verification queued")
        gate.set()
        await blocker
        assert await asyncio.gather(*sessions, third) == ["a", "b", "c"]
        assert calls[0] == ["a", "b"]
        if shared:
            assert calls[1:] == [["c", "a", "b"]]
        else:
            assert calls[1] == ["c"] and sum(calls[2:], []) == ["a", "b"]
    finally:
        thread.stop()


async def test_a_pass_that_causes_no_follow_up_delays_the_next_job_only_by_the_wait():
    """A job answered with nothing to follow (a session's close): the thread waits out its
    wait once, then serves what comes; stop() ends it while it waits."""
    thread = ComputeThread("test", max_batch=8)
    thread.share_between_roles(0.05)
    lane = thread.lane()
    try:
        assert await lane.run(lambda: "closed") == "closed"
        assert await lane.run_batched("k", lambda items: [i * 2 for i in items], 21) == 42
        assert lane.stats.jobs == 2 and lane.stats.passes == 2
    finally:
        thread.stop()
    assert not thread._thread.is_alive()


def test_batched_verification_equals_one_session_at_a_time(tiny):
    """Sessions of different lengths, chain and tree proposals and a proposal that does not
    fit: verified together they commit exactly what each commits alone, to the end."""
    from specctl.engine.tree import TokenTree
    from specctl.spec.batched_verify import apply_many
    from specctl.spec.decode import DecodeSession
    from specctl.spec.rounds import generate
    from specctl.spec.drafters import ModelTreeDrafter, Proposal

    target = tiny["llama"]
    chain, tree = ModelChainDrafter(tiny["llama-self2"], 3), ModelTreeDrafter(tiny["llama-draft"], 3, 2, 3)
    prompts = [[1, 2, 3, 4, 5], [9, 8], [40, 41, 42, 43, 44, 45, 46], [300, 301]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    drafters = [chain, tree, chain, tree]
    sessions = [DecodeSession(target, p, params, max_nodes=d.max_nodes) for p, d in zip(prompts, drafters)]
    for s in sessions:
        s.prefill()
    bad = Proposal(TokenTree.root(7))  # root is not the session's last token
    assert isinstance(apply_many([(sessions[0], bad), (sessions[1], Proposal(TokenTree.root(sessions[1].seq[-1])))])[0],
                      ValueError)
    verify_together_to_the_end(sessions, drafters)
    for prompt, session in zip(prompts, sessions):
        assert session.output == generate(target, prompt, params)[0]
        assert session.cache.length == len(session.seq) - 1


def test_batched_tree_drafting_matches_one_at_a_time(tiny):
    from specctl.spec.batch_drafting import propose_trees
    from specctl.spec.drafters import ModelTreeDrafter

    drafter = ModelTreeDrafter(tiny["llama-self2"], 3, 2, 3)
    seqs = [[1, 2, 3, 4], [50, 60], [7, 7, 7, 7, 7, 7]]
    for params in (SamplingParams(), SamplingParams(temperature=0.8, top_k=20)):
        alone, alone_probs = [], []
        for s in seqs:
            session = drafter.open(64)
            tree = session.propose(s, params, None).tree
            alone.append((tree.tokens.tolist(), tree.parents.tolist(), session.fed, session.cache.length))
            alone_probs.append(tree.probs)
        sessions = [drafter.open(64) for s in seqs]
        together = propose_trees(sessions, seqs, [params] * 3, [None] * 3)
        assert [(p.tree.tokens.tolist(), p.tree.parents.tolist(), s.fed, s.cache.length)
                for p, s in zip(together, sessions)] == alone
        for proposal, probs in zip(together, alone_probs):
            torch.testing.assert_close(proposal.tree.probs, probs, rtol=1e-5, atol=1e-6)


async def test_a_slowed_lane_pads_quick_verifications_to_its_floor_and_leaves_slow_ones_alone(monkeypatch):
    """The emulation of a target device (bench prespec's --verify-time-ms): the work runs on the
    lane at once and the lane then waits out the rest of the floor; a delay (bench star) comes first."""
    import specctl.runtime.compute as compute_module

    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(seconds: float) -> None:
        slept.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(compute_module.asyncio, "sleep", recording_sleep)
    compute = ComputeThread("test", max_batch=8).lane(owns_thread=True)
    try:
        floored = SlowedLane(compute, 0.0, floor_s=30.0)
        assert await floored.run_batched("k", lambda items: [i * 2 for i in items], 4) == 8
        assert len(slept) == 1 and 29.0 < slept[0] <= 30.0  # a quick item waits out nearly all of the floor
        slept.clear()
        floored = SlowedLane(compute, 0.0, floor_s=0.001)
        assert await floored.run_batched("k", lambda items: time.sleep(0.05) or items, 5) == 5
        assert slept == []  # work longer than the floor is not padded
        delayed = SlowedLane(compute, 2.0)
        assert await delayed.run_batched("k", lambda items: items, 6) == 6
        assert slept == [2.0]
    finally:
        compute.stop()


def test_a_negative_emulated_verification_time_is_refused_by_the_target_config():
    with pytest.raises(ValueError, match="verify_delay_s and verify_floor_s must be >= 0"):
        TargetServerConfig(port=0, verify_floor_s=-0.1)
