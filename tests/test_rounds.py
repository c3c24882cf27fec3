"""The round loop with a remote speculator: the draft-session lifecycle when a Propose
fails or times out (no draft session may outlive its round), and the one definition of
rounds in the stats."""

import asyncio
import time

import pytest

from specctl.draft.server import DraftServer, DraftServerConfig
from specctl.engine.loader import load_model
from specctl.spec.drafters import DraftSession, Drafter, ModelChainDrafter
from specctl.spec.rounds import generate
from specctl.spec.params import SamplingParams
from specctl.spec.stats import counted_draft
from specctl.verify.client import remote_generate
from specctl.verify.draft_client import DraftClient
from specctl.verify.server import TargetServer, TargetServerConfig

PROMPTS = [[5, 9, 13, 2], [7, 8, 9, 10, 7, 8, 9], [42, 43, 44, 45, 46]]


@pytest.fixture(scope="module")
def models(tiny_dir):
    target = load_model("tiny-llama", tiny_dir["llama"], "fp32")
    draft = load_model("tiny-llama@2", tiny_dir["llama"], "fp32", num_layers=2)
    return target, draft


class FailingEveryThirdDrafter(Drafter):
    """Fault injection: a real chain drafter whose sessions fail every third proposal."""

    def __init__(self, inner: Drafter) -> None:
        self.inner, self.max_nodes, self.calls = inner, inner.max_nodes, 0

    def open(self, capacity, pool=None) -> DraftSession:
        drafter, session = self, self.inner.open(capacity, pool)

        class _Session(DraftSession):
            def propose(self, seq, params, generator):
                drafter.calls += 1
                if drafter.calls % 3 == 0:
                    raise RuntimeError("injected draft failure")
                return session.propose(seq, params, generator)

            def on_verified(self, path):
                session.on_verified(path)

            def close(self):
                session.close()

        return _Session()


async def _star(models, drafter, timeout_s=30.0, **target_options):
    target, draft = models
    draft_server = DraftServer(draft, drafter, DraftServerConfig(port=0))
    draft_port = await draft_server.start()
    client = DraftClient("127.0.0.1", draft_port, model=target.name, fingerprint=target.vocab_fingerprint,
                         timeout_s=timeout_s)
    first = asyncio.get_running_loop().create_future()
    link = asyncio.create_task(client.run(first))
    assert await first
    target_server = TargetServer(target, TargetServerConfig(port=0, **target_options), client)
    return draft_server, link, target_server, await target_server.start()


async def _stop(draft_server, link, target_server):
    link.cancel()
    await target_server.close()
    await draft_server.close()


async def _drained(draft_server, target_server, timeout=20.0):
    """Until every session is gone on both sides (the closes are queued on the compute threads)."""
    async def done():
        while draft_server.table.states or target_server.active or draft_server.active_sessions:
            await asyncio.sleep(0.01)
    await asyncio.wait_for(done(), timeout)


def _reference(models, prompt, params):
    return generate(models[0].decoder, prompt, params)[0]


async def test_a_failed_propose_closes_its_draft_session_and_the_output_stays_exact(models):
    drafter = FailingEveryThirdDrafter(ModelChainDrafter(models[1].decoder, 3))
    draft_server, link, target_server, port = await _star(models, drafter)
    try:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        for prompt in PROMPTS:
            tokens, _, stats = await remote_generate("127.0.0.1", port, prompt, params)
            assert tokens == _reference(models, prompt, params)
            assert stats["fallback_rounds"] > 0 and stats["drafts"] > 0
            assert stats["rounds"] == stats["drafts"] + stats["ar_rounds"]
            assert stats["draft_ms"] > 0  # the wait for the draft server's proposals
            # Measured directly: no draft session and no draft KV byte outlives the session.
            await _drained(draft_server, target_server)
            assert draft_server.table.pool.used_bytes == 0 and draft_server.table.pool.sessions == 0
        assert drafter.calls >= 3
    finally:
        await _stop(draft_server, link, target_server)


async def test_a_timed_out_propose_closes_its_draft_session_and_the_output_stays_exact(models):
    draft_server, link, target_server, port = await _star(models, ModelChainDrafter(models[1].decoder, 3), timeout_s=0.3)
    try:
        params = SamplingParams(max_tokens=120, ignore_eos=True)
        stalled = []

        def stall_once(tokens):
            # At the first token, stall the draft server's compute for longer than the
            # target waits for a proposal (0.3 s): the next Propose times out.
            if not stalled:
                stalled.append(True)
                draft_server.compute.submit_nowait(time.sleep, 1.0)

        tokens, _, stats = await remote_generate("127.0.0.1", port, PROMPTS[0], params, stall_once)
        assert tokens == _reference(models, PROMPTS[0], params)
        assert stats["fallback_rounds"] >= 1
        await _drained(draft_server, target_server)
        assert draft_server.table.pool.used_bytes == 0
        assert target_server.snapshot()["fallback_rounds"] == stats["fallback_rounds"]
    finally:
        await _stop(draft_server, link, target_server)


def test_autoregressive_rounds_are_rounds_but_not_drafts(tiny):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    _, stats, _ = generate(tiny["llama"], [1, 2, 3], params)
    assert (stats.rounds, stats.drafts, stats.ar_rounds, stats.drafted, stats.mean_accepted_length) == (11, 0, 11, 0, 0.0)
    _, stats, _ = generate(tiny["llama"], [1, 2, 3], params, ModelChainDrafter(tiny["llama-draft"], 3))
    assert stats.rounds == stats.drafts > 0 and stats.ar_rounds == 0 and stats.drafted == 3 * stats.drafts
    assert stats.to_dict()["fallback_rounds"] == 0


def test_draft_tokens_past_the_end_are_neither_drafted_nor_accepted(tiny):
    # the target drafting for itself: every draft token is accepted, and max_tokens cuts the round
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    tokens, stats, _ = generate(tiny["llama"], [1, 2, 3], params, ModelChainDrafter(tiny["llama"], 4))
    assert len(tokens) == 2
    assert (stats.rounds, stats.drafts, stats.drafted, stats.accepted, stats.accepted_per_pos) == (1, 1, 1, 1, [1])
    assert (stats.mean_accepted_length, stats.acceptance_rate) == (2.0, 1.0)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    _, stats, _ = generate(tiny["llama"], [1, 2, 3], params, ModelChainDrafter(tiny["llama"], 4))
    assert (stats.drafted, stats.accepted, stats.accepted_per_pos) == (3, 3, [1, 1, 1])


def test_counted_draft_cuts_only_inside_the_accepted_tokens():
    assert counted_draft(0, 0, 1) == (0, 0)  # autoregressive
    assert counted_draft(4, 2, 3) == (4, 2)  # accepted + bonus: nothing cut
    assert counted_draft(4, 4, 5) == (4, 4)
    assert counted_draft(4, 2, 2) == (2, 2)  # the bonus cut: position 3's rejection decided nothing
    assert counted_draft(4, 4, 1) == (1, 1)
    assert counted_draft(4, 3, 0) == (1, 0)  # a stop string took all: still a draft round


async def test_a_target_without_a_draft_server_is_autoregressive_by_choice_not_by_fallback(models):
    target_server = TargetServer(models[0], TargetServerConfig(port=0), None)
    assert target_server.session_nodes == 1  # a session's KV holds the root alone; greedy ones may run ahead
    port = await target_server.start()
    try:
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        tokens, _, stats = await remote_generate("127.0.0.1", port, PROMPTS[0], params)
        assert tokens == _reference(models, PROMPTS[0], params)
        assert (stats["rounds"], stats["ar_rounds"], stats["drafts"], stats["fallback_rounds"]) == (9, 9, 0, 0)
    finally:
        await target_server.close()


def _begun(models, target_server):
    """A session with a remote speculator that has begun opening its draft session."""
    from specctl.spec.decode import DecodeSession
    from specctl.verify.speculator import RemoteSpeculator

    session = DecodeSession(models[0].decoder, PROMPTS[0], SamplingParams(max_tokens=8), (), None, None, 4)
    speculator = RemoteSpeculator(target_server.draft, 4)
    speculator.begin(session)
    return session, speculator


async def test_prefill_finishing_before_the_open_is_sent_still_drafts_from_the_prompt(models):
    """begin() snapshots the text: a prefill that commits its first token before the
    opening task runs must not make the first Propose carry no tokens (a race seen on CI)."""
    draft_server, link, target_server, _ = await _star(models, ModelChainDrafter(models[1].decoder, 3))
    try:
        session, speculator = _begun(models, target_server)
        session.prefill()  # in this loop step, before the opening task has run
        drafted = await speculator.propose(session)
        assert drafted.fallback is None and drafted.proposal is not None
        assert int(drafted.proposal.tree.tokens[0]) == session.seq[-1]
        speculator.close()
        session.close()
    finally:
        await _stop(draft_server, link, target_server)


async def test_a_round_cancelled_just_as_its_draft_session_opens_still_closes_it(models):
    """The session ends (client disconnect) in the loop step where the opening it waits on
    completes: the handle never reaches the speculator, yet the draft session must close
    (CI once left one open on the draft server after a gateway client hung up)."""
    draft_server, link, target_server, _ = await _star(models, ModelChainDrafter(models[1].decoder, 3))
    try:
        session, speculator = _begun(models, target_server)
        session.prefill()
        opening = speculator._opening
        rounds: list[asyncio.Task] = []
        # Registered before the round waits on the opening, so it runs first when the opening
        # completes: the round is cancelled with its wake-up already due.
        opening.add_done_callback(lambda _: rounds[0].cancel())
        rounds.append(asyncio.ensure_future(speculator.propose(session)))
        with pytest.raises(asyncio.CancelledError):
            await rounds[0]
        assert opening.result() is not None  # the draft session was opened ...
        speculator.close()  # ... and the round loop's `finally` closes it
        session.close()
        await _drained(draft_server, target_server)
        assert draft_server.table.snapshot()["sessions"] == 0
    finally:
        await _stop(draft_server, link, target_server)


async def test_chunked_prefills_on_both_sides_keep_the_output_and_free_every_session(models):
    """Target and draft prefill a prompt 8 tokens a job (the draft before its first proposal,
    which waits for it): the output is the target alone's, every proposal drafted from the whole
    prompt (no fallback), and no session or byte of KV stays on either side."""
    target, draft = models
    target.decoder.prefill_chunk = draft.decoder.prefill_chunk = 8
    draft_server, link, target_server, port = await _star(models, ModelChainDrafter(draft.decoder, 3))
    try:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        prompt = list(range(5, 45))
        jobs = draft_server.compute.stats.jobs
        tokens, _, stats = await remote_generate("127.0.0.1", port, prompt, params)
        assert tokens == _reference(models, prompt, params)
        assert stats["fallback_rounds"] == 0 and stats["drafts"] == stats["rounds"]
        # open, 4 chunks (the first proposal's catch-up feeds the last 8 tokens), a proposal a round
        assert draft_server.compute.stats.jobs - jobs >= 1 + 4 + stats["rounds"]
        await _drained(draft_server, target_server)
        assert draft_server.table.pool.used_bytes == 0 and draft_server.table.pool.sessions == 0
    finally:
        target.decoder.prefill_chunk = draft.decoder.prefill_chunk = 0
        await _stop(draft_server, link, target_server)
