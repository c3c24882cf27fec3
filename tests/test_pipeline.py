"""Pipeline stages (verify --stage i/n): the split, the exactness of a target split over
2-4 stages in every mode, the KV invariant after every round, freed state, a stage that
dies and comes back, bad frames to a stage, and dead forwards dropped ahead of the queue."""

import asyncio
import socket

import pytest

from specctl.engine.loader import load_model
from specctl.engine.parts import decoder_part
from specctl.errors import ConfigError, StageUnavailable
from specctl.net.framing import read_message
from specctl.net.handshake import client_handshake
from specctl.net.protocol import (StatsRequest, Error, ProtocolError, StageDrop, StageForward, StageKeep, StageOpen, StageOutput, Tensor,
                                   decode, encode)
from specctl.pipeline.local import LocalPipeline
from specctl.pipeline.split import balanced_split, parse_layers, plan_stage
from specctl.pipeline.worker import StageStats, StageWorker, keep_positions, rows_to_compute, split_keep
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter, NgramDrafter
from specctl.spec.rounds import generate
from specctl.spec.params import SamplingParams
from tests.conftest import wait_until

PROMPTS = [[5, 9, 13, 2], [7, 8, 9, 10, 7, 8, 9], [42, 43, 44, 45, 46]]


def test_balanced_split_gives_every_stage_a_contiguous_share():
    assert balanced_split(4, 1) == [(0, 4)]
    assert balanced_split(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert balanced_split(28, 8) == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 19), (19, 22), (22, 25), (25, 28)]
    with pytest.raises(ConfigError, match="cannot split 4 layers into 5 stages"):
        balanced_split(4, 5)


def test_stage_plan_from_the_command_line():
    plan = plan_stage(2, 3, 4, "a:1,b:2,c:3", None)
    assert (plan.layers, plan.listen, plan.next, plan.first, plan.last) == ((2, 3), ("b", 2), ("c", 3), False, False)
    last = plan_stage(3, 3, 4, "a:1,b:2,c:3", "1:4")
    assert (last.layers, last.next, last.last) == ((1, 4), None, True)
    with pytest.raises(ConfigError, match="needs --pipeline with 3 HOST:PORT addresses"):
        plan_stage(1, 3, 4, "a:1,b:2", None)
    with pytest.raises(ConfigError, match="expected HOST:PORT, got 'b'"):
        plan_stage(1, 2, 4, "a:1,b", None)
    with pytest.raises(ConfigError, match=r"--layers 3:9: need 0 <= a < b <= 4"):
        parse_layers("3:9", 4)


def test_keep_travels_as_prefix_and_tail():
    keep = [0, 1, 2, 3, 5, 8]
    assert split_keep(keep) == (4, [5, 8])
    assert keep_positions(*split_keep(keep)).tolist() == keep
    assert split_keep(list(range(6))) == (6, [])


@pytest.fixture(scope="module")
def models(tiny_dir):
    return load_model("t", tiny_dir["llama"], "fp32"), load_model("d", tiny_dir["llama-draft"], "fp32")


def _drafter(mode, draft):
    return {"ar": None, "ngram": NgramDrafter(4), "chain": ModelChainDrafter(draft.decoder, 4),
            "tree": ModelTreeDrafter(draft.decoder, 4, 2, 3)}[mode]


@pytest.mark.parametrize("stages", [2, pytest.param(3, marks=pytest.mark.slow), 4])  # 5-7 s each
async def test_a_target_split_over_stages_outputs_exactly_the_whole_target_in_every_mode(models, stages):
    target, draft = models
    async with LocalPipeline(target, stages) as pipeline:
        staged = pipeline.staged
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        for mode in ("ar", "ngram", "chain", "tree"):
            for prompt in PROMPTS:
                reference = generate(target.decoder, prompt, params, _drafter(mode, draft))[0]
                tokens, stats, _ = await asyncio.to_thread(generate, staged.decoder, prompt, params, _drafter(mode, draft))
                assert tokens == reference, (mode, prompt)
                assert stats.rounds > 0
        # Every session's KV is freed on every stage.
        await wait_until(lambda: all(s.pool.sessions == 0 and s.pool.used_bytes == 0 for s in pipeline.servers),
                         what="stage KV freed")
        assert all(s.stats.forwards > 0 and s.stats.opened == s.stats.closed for s in pipeline.servers)


@pytest.mark.parametrize("mode", ["chain", "tree"])
async def test_sampling_through_two_stages_draws_what_the_whole_target_draws(models, mode):
    """The stages ship the exact logits: with the same seed the sampled tokens are the same
    as the whole target's (hence the same distribution)."""
    target, draft = models
    async with LocalPipeline(target, 2) as pipeline:
        staged = pipeline.staged
        for seed in range(4):
            params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)
            reference = generate(target.decoder, PROMPTS[seed % 3], params, _drafter(mode, draft))[0]
            tokens = (await asyncio.to_thread(generate, staged.decoder, PROMPTS[seed % 3], params,
                                              _drafter(mode, draft)))[0]
            assert tokens == reference


async def test_penalties_and_prompt_logprobs_through_two_stages_are_the_whole_targets(models):
    from specctl.spec.decode import DecodeSession

    target, draft = models
    async with LocalPipeline(target, 2) as pipeline:
        staged = pipeline.staged
        for seed, temperature in ((0, 0.0), (1, 0.9)):
            params = SamplingParams(max_tokens=20, temperature=temperature, seed=seed, ignore_eos=True,
                                    presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.4)
            reference = generate(target.decoder, PROMPTS[0], params, _drafter("chain", draft))[0]
            assert (await asyncio.to_thread(generate, staged.decoder, PROMPTS[0], params,
                                            _drafter("chain", draft)))[0] == reference
        params = SamplingParams(max_tokens=2, prompt_logprobs=2)
        whole = DecodeSession(target.decoder, PROMPTS[1], params)
        split = await asyncio.to_thread(DecodeSession, staged.decoder, PROMPTS[1], params)
        assert len(split.prompt_logprobs) == len(PROMPTS[1]) - 1
        for (lp, ids, values, rank), (ref_lp, ref_ids, ref_values, ref_rank) in zip(split.prompt_logprobs,
                                                                                  whole.prompt_logprobs):
            assert ids == ref_ids and rank == ref_rank
            assert lp == pytest.approx(ref_lp, abs=1e-5) and values == pytest.approx(ref_values, abs=1e-5)
        whole.close()
        await asyncio.to_thread(split.close)
        await wait_until(lambda: all(s.pool.sessions == 0 and s.pool.used_bytes == 0 for s in pipeline.servers),
                         what="stage KV freed")


async def test_every_stage_holds_exactly_the_committed_kv_after_every_round(models):
    """No stage over-advances after a rejection: after each round, once the round's pruning
    has arrived, every stage's KV length equals the committed text less its last token."""
    target, draft = models
    async with LocalPipeline(target, 3) as pipeline:
        staged = pipeline.staged
        loop = asyncio.get_running_loop()
        prompt, seen = PROMPTS[1], []

        def lengths() -> list[int]:
            return [c.length for s in pipeline.servers for w in list(s.workers) for c in list(w.caches.values())]

        def after_round(tokens, result):
            seen.append(len(tokens))
            committed = len(prompt) + sum(seen)
            asyncio.run_coroutine_threadsafe(
                wait_until(lambda: lengths() == [committed - 1] * 2, what=f"stage KV at {committed - 1}"), loop).result()

        tokens, stats, _ = await asyncio.to_thread(
            generate, staged.decoder, prompt, SamplingParams(max_tokens=30, ignore_eos=True),
            ModelTreeDrafter(draft.decoder, 4, 2, 3), on_tokens=after_round)
        assert len(tokens) == 30 and stats.drafts > 0 and len(seen) == stats.rounds + 1
        assert sum(s.stats.pruned for s in pipeline.servers) > 0  # rejected tree nodes were dropped everywhere


async def test_a_stage_that_dies_ends_its_sessions_clearly_and_a_restarted_one_serves_new_sessions(models):
    target, _ = models
    async with LocalPipeline(target, 3) as pipeline:
        staged = pipeline.staged
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        last, port = pipeline.servers[-1], pipeline.ports[-1]
        started = asyncio.Event()
        loop = asyncio.get_running_loop()
        running = asyncio.create_task(asyncio.to_thread(
            generate, staged.decoder, PROMPTS[0], params, None,
            on_tokens=lambda tokens, result: loop.call_soon_threadsafe(started.set)))
        await started.wait()
        await last.close()  # stage 3 goes away mid-session
        # In flight or between rounds, the session ends with the reason.
        with pytest.raises(StageUnavailable, match=r"the pipeline (chain broke|is down) \((the stage at|pipeline stage 3 at) 127.0.0.1:"):
            await running
        # Stage 2 freed the chain's KV; stage 1 tells new sessions why it cannot serve them.
        await wait_until(lambda: pipeline.servers[0].pool.sessions == 0, what="stage 2 freed")
        await wait_until(lambda: "is unreachable from stage 2" in (pipeline.client.last_error or ""),
                         what="a failed attempt to rebuild the chain")
        with pytest.raises(StageUnavailable, match="stage 3 at 127.0.0.1:.* is unreachable from stage 2"):
            await asyncio.to_thread(generate, staged.decoder, PROMPTS[0], params)
        # Restart stage 3 on its port: stage 1 rebuilds the chain, new sessions are exact again.
        pipeline.servers.pop()
        pipeline.ports.pop()
        await pipeline.start_stage(3, None, port=port)
        await wait_until(pipeline.client.connected.is_set, what="chain rebuilt")
        short = SamplingParams(max_tokens=16, ignore_eos=True)
        assert (await asyncio.to_thread(generate, staged.decoder, PROMPTS[2], short))[0] == \
            generate(target.decoder, PROMPTS[2], short)[0]
        assert pipeline.client.reconnects == 1


async def test_bad_frames_to_a_stage_get_an_error_and_disturb_nothing_else(models):
    target, _ = models
    async with LocalPipeline(target, 2) as pipeline:
        staged = pipeline.staged
        stage = pipeline.servers[0]
        # Garbage instead of a handshake: that connection is closed, the stage goes on.
        with socket.create_connection(("127.0.0.1", pipeline.ports[0])) as sock:
            sock.sendall(b"\x00\x00\x00\x05hello")
        # A well-formed stage peer sending a forward for a session it never opened.
        reader, writer = await asyncio.open_connection("127.0.0.1", pipeline.ports[0])
        await client_handshake(reader, writer, role="stage", model="t", fingerprint=target.vocab_fingerprint,
                               layers=[0, 2])
        import torch
        hidden = torch.zeros(1, target.spec.hidden_size)
        writer.write(encode(StageForward(7, [99], [1], Tensor.from_torch(torch.tensor([0])), [None], [[0]],
                                         Tensor.from_torch(hidden))))
        reply = await read_message(reader)
        assert isinstance(reply, Error) and reply.code == "stage_failed" and reply.req == 7
        assert reply.message == "pipeline stage 2: unknown stage session 99"
        writer.close()
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        assert (await asyncio.to_thread(generate, staged.decoder, PROMPTS[0], params))[0] == \
            generate(target.decoder, PROMPTS[0], params)[0]
        assert stage.rejected_requests >= 1


async def _as_stage_one(pipeline, target):
    """A connection to stage 2 that speaks as stage 1 would (frames written by the test)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", pipeline.ports[0])
    await client_handshake(reader, writer, role="stage", model="t", fingerprint=target.vocab_fingerprint,
                           layers=[0, pipeline.servers[0].model.decoder.layer_range[0]])
    return reader, writer


async def test_a_drop_overtakes_the_queued_forwards_and_the_live_rows_after_it_are_exact(models):
    """Forwards queue behind a slow stage; a StageDrop sent after them takes effect at once:
    the dead ones come back empty without compute, their rows hold KV positions until the
    pruning, and the next live forward equals the same forward in a session that never had
    the dead rows."""
    import torch
    target, _ = models
    async with LocalPipeline(target, 2, delay_s=0.3) as pipeline:
        stage = pipeline.servers[0]
        reader, writer = await _as_stage_one(pipeline, target)
        hidden = torch.randn(4, target.spec.hidden_size, generator=torch.Generator().manual_seed(0))

        def forward(fid, sid, rows, tag):
            n = len(rows)
            return StageForward(fid, [sid], [n], Tensor.from_torch(torch.tensor(rows)), [None], [list(range(n))],
                                Tensor.from_torch(hidden[rows]), "logits", [tag])

        for message in (StageOpen(1, 16), forward(1, 1, [0, 1], 0), forward(2, 1, [2], 1), forward(3, 1, [3], 2),
                        StageDrop(1, [1, 2])):
            writer.write(encode(message))
        replies = {}
        for _ in range(3):
            reply = await read_message(reader)
            assert isinstance(reply, StageOutput), reply
            replies[reply.fid] = reply.logits.to_torch()
        assert replies[1].shape[0] == 2 and replies[2].numel() == replies[3].numel() == 0
        assert (stage.stats.dropped_forwards, stage.stats.dropped_tokens, stage.stats.forwards) == (2, 2, 1)
        worker = next(w for w in stage.workers if w.caches)  # this connection's (not stage 1's chain)
        assert worker.caches[1].length == 4 and worker.dead == {}  # the dead rows hold their places
        for message in (StageKeep(1, 2), forward(4, 1, [2], 3), StageOpen(2, 16), forward(5, 2, [0, 1], 0),
                        forward(6, 2, [2], 1)):
            writer.write(encode(message))
        for _ in range(3):
            reply = await read_message(reader)
            replies[reply.fid] = reply.logits.to_torch()
        assert torch.equal(replies[4], replies[6]) and torch.equal(replies[1], replies[5])
        assert worker.caches[1].length == worker.caches[2].length == 3
        writer.close()
        await wait_until(lambda: stage.pool.sessions == 0, what="the connection's sessions freed")


async def test_dead_rows_of_a_live_forward_are_not_computed_and_the_live_rows_are_exact(models):
    """A drop naming some rows of a queued forward: the stages (a middle one, then the last)
    compute only the others, the dead rows come back as zeros, keep their KV positions until
    the pruning, and every live row, then the next forward, equals a session that never had
    the dead row (each forward the same shape in both, so the comparison is exact)."""
    import torch
    target, _ = models
    async with LocalPipeline(target, 3, delay_s=0.3) as pipeline:
        middle = pipeline.servers[0]
        reader, writer = await _as_stage_one(pipeline, target)
        hidden = torch.randn(6, target.spec.hidden_size, generator=torch.Generator().manual_seed(1))

        def forward(fid, sid, rows, positions, tail, tag):
            n = len(rows)
            mask = None if tail is None else Tensor.from_torch(torch.tensor(tail, dtype=torch.bool))
            return StageForward(fid, [sid], [n], Tensor.from_torch(torch.tensor(positions)), [mask],
                                [list(range(n))], Tensor.from_torch(hidden[rows]), "logits", [tag])

        siblings = [[1, 0, 0], [0, 1, 0], [0, 0, 1]]  # three nodes at position 2, each over the prefix
        child = [[0, 1, 1]]  # a child of the third, over the two nodes kept and itself
        with_dead_row = [StageOpen(1, 16), forward(1, 1, [0, 1], [0, 1], None, 0),
                         forward(2, 1, [2, 3, 4], [2, 2, 2], siblings, 1), StageDrop(1, [1], [[1]]),
                         StageKeep(1, 2, [2, 4]), forward(3, 1, [5], [3], child, 2)]
        never_had_it = [StageOpen(2, 16), forward(4, 2, [0, 1], [0, 1], None, 0),
                        forward(5, 2, [2, 4], [2, 2], [[1, 0], [0, 1]], 1), forward(6, 2, [5], [3], child, 2)]
        replies = {}
        for batch in (with_dead_row, never_had_it):
            for message in batch:
                writer.write(encode(message))
            for _ in range(3):
                reply = await read_message(reader)
                assert isinstance(reply, StageOutput), reply
                replies[reply.fid] = reply.logits.to_torch()
        assert torch.equal(replies[2][[0, 2]], replies[5]) and not replies[2][1].any()
        assert torch.equal(replies[1], replies[4]) and torch.equal(replies[3], replies[6])
        last = pipeline.servers[1]
        assert (middle.stats.skipped_rows, last.stats.skipped_rows) == (1, 1)
        assert middle.stats.dropped_forwards == last.stats.dropped_forwards == 0
        writer.close()
        await wait_until(lambda: all(s.pool.sessions == 0 for s in pipeline.servers), what="the sessions freed")


def test_rows_to_compute_keeps_a_causal_forward_whole_unless_all_of_it_is_dead():
    assert rows_to_compute([3, 2, 4, 2], [False, True, True, False], [{1}, {0}, None, set()]) == \
        [[0, 2], [0, 1], [], [0, 1]]


def test_a_drop_naming_rows_for_fewer_forwards_than_tags_is_refused():
    import msgspec
    for body, error in (({"sid": 1, "tags": [3, 4], "rows": [[0]]}, "a stage drop lists rows for 1 forwards but tags 2"),
                        ({"sid": 1, "tags": [3], "rows": [[-1]]}, "a stage drop's rows must be >= 0")):
        with pytest.raises(ProtocolError, match=f"invalid message: {error}"):
            decode(msgspec.msgpack.encode({"type": "StageDrop", **body}))
        with pytest.raises(ValueError, match=error):
            StageDrop(**body)


def test_partial_drops_merge_and_a_whole_drop_wins():
    worker = StageWorker(None, None, StageStats())
    worker.mark_dead(StageDrop(1, [5, 6], [[0], [2]]), most=4)
    worker.mark_dead(StageDrop(1, [5, 6], [[3], []]), most=4)
    worker.mark_dead(StageDrop(1, [6], [[1]]), most=4)
    assert worker.dead == {1: {5: {0, 3}, 6: None}}


def test_a_forward_with_every_row_listed_dead_goes_hollow_and_a_malformed_one_is_refused():
    import torch

    from specctl.engine.kv_cache import KVCache
    from specctl.errors import BadRequest

    worker = StageWorker(None, None, StageStats())
    worker.mark_dead(StageDrop(1, [5, 6], [[0, 1, 2], [1]]), most=4)

    def forward(tag, lengths=(3,), masks=(None,)):
        n = sum(lengths)
        return StageForward(tag, [1], list(lengths), Tensor.from_torch(torch.arange(n)), list(masks), [[0]],
                            Tensor.from_torch(torch.zeros(n, 4)), "logits", [tag])

    assert worker.dead_rows(forward(5)) == [None]  # listed row by row, all of them: as a whole drop
    assert worker.dead_rows(forward(6)) == [{1}] and worker.dead == {}
    worker.caches[1] = KVCache(1, 1, 4, 16, torch.float32)
    for bad in (forward(7, lengths=(2, 1)), forward(7, masks=(None, None))):
        with pytest.raises(BadRequest, match="a stage forward's sessions, lengths, masks and logits rows disagree"):
            worker.forward(bad)
    assert worker.caches[1].length == 0


def test_stray_drops_cannot_grow_a_stage_past_what_can_be_queued():
    worker = StageWorker(None, None, StageStats())
    worker.mark_dead(StageDrop(1, list(range(10))), most=4)
    worker.mark_dead(StageDrop(1, [20]), most=4)
    assert worker.dead == {1: {0: None, 1: None, 2: None, 3: None}}
    for sid in range(2, 9):
        worker.mark_dead(StageDrop(sid, [0]), most=4)
    assert sorted(worker.dead) == [1, 2, 3, 4]


async def test_a_stage_whose_layers_do_not_follow_the_previous_stage_is_refused(models):
    import dataclasses

    from specctl.pipeline.launch import pipelined_target
    from specctl.pipeline.stage import StageServer, StageServerConfig

    target, _ = models
    last = dataclasses.replace(target, decoder=decoder_part(target.decoder, (3, 4), False, True))
    server = StageServer(last, StageServerConfig(port=0, index=2, count=2))
    port = await server.start()
    first = dataclasses.replace(target, decoder=decoder_part(target.decoder, (0, 2), True, False))  # layer 2 is missing
    _, client = pipelined_target(first, ("127.0.0.1", port), stages=2)
    connected = asyncio.get_running_loop().create_future()
    link = asyncio.create_task(client.run(connected))
    try:
        assert await connected is False
        assert client.last_error == ("pipeline stage 2 holds layers from 3 but the previous stage sent layers 0:2: "
                                     "every stage must start where the previous one ends (check --layers and "
                                     "--stage on both)")
        assert server.chains == 0
    finally:
        link.cancel()
        await server.close()


def test_the_first_and_last_stage_must_hold_the_ends_of_the_model():
    with pytest.raises(ConfigError, match="stage 1 must start at layer 0 and stage 2 end at layer 4"):
        plan_stage(2, 2, 4, "a:1,b:2", "2:3")


async def test_many_sessions_keep_several_micro_batches_in_flight_and_stay_exact(models, tiny_dir):
    """SpecPipe-DB's batch mode: a pipelined target instance with a draft server serves 6
    sessions at once; groups of sessions go down the chain as micro-batches without waiting
    for each other, and every output is the whole target's."""
    from specctl.draft.server import DraftServer, DraftServerConfig
    from specctl.verify.client import remote_generate
    from specctl.verify.draft_client import DraftClient
    from specctl.verify.server import TargetServer, TargetServerConfig

    target, draft = models
    prompts = PROMPTS * 2
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    references = [generate(target.decoder, p, params)[0] for p in prompts]
    draft_server = DraftServer(draft, ModelChainDrafter(draft.decoder, 3), DraftServerConfig(port=0))
    client = DraftClient("127.0.0.1", await draft_server.start(), model=target.name,
                         fingerprint=target.vocab_fingerprint)
    connected = asyncio.get_running_loop().create_future()
    link = asyncio.create_task(client.run(connected))
    assert await connected
    async with LocalPipeline(target, 3) as pipeline:
        server = TargetServer(pipeline.staged, TargetServerConfig(port=0, max_batch=2), client,
                              pipeline=pipeline.client)
        port = await server.start()
        try:
            results = await asyncio.gather(*(remote_generate("127.0.0.1", port, p, params) for p in prompts))
            assert [tokens for tokens, _, _ in results] == references
            assert all(stats["drafts"] > 0 for _, _, stats in results)
            assert pipeline.client.most_in_flight >= 2  # micro-batches overlapped in the chain
            await wait_until(lambda: all(s.pool.sessions == 0 for s in pipeline.servers), what="stage KV freed")
        finally:
            await server.close()
    link.cancel()
    await draft_server.close()


async def test_a_session_checking_the_link_while_it_closes_reads_why_it_broke():
    """The client clears `connected` before it awaits the link's close: a session that checks in
    that window once read "not connected yet" instead of the stage's error (seen on CI-like load)."""
    from specctl.pipeline.decoder import PipelineClient

    closing, release = asyncio.Event(), asyncio.Event()

    class SlowToCloseLink:
        address = "127.0.0.1:1"

        def __init__(self, on_reply):
            self.closed, self.error = asyncio.Event(), None

        async def connect(self):
            pass

        def post(self, message):
            pass

        async def close(self):
            closing.set()
            await release.wait()

    client = PipelineClient(SlowToCloseLink)
    first = asyncio.get_running_loop().create_future()
    runner = asyncio.create_task(client.run(first))
    try:
        assert await first
        epoch = client.epoch
        client.link.error = "the stage at 127.0.0.1:1 went away"
        client.link.closed.set()
        await closing.wait()  # connected is cleared; close() has not returned
        with pytest.raises(StageUnavailable, match=r"the pipeline is down \(the stage at 127\.0\.0\.1:1 went away\)"):
            client._check(epoch)
    finally:
        release.set()
        runner.cancel()


async def test_a_chain_whose_last_stage_stops_answering_is_dropped_and_a_long_forward_is_not(models, monkeypatch,
                                                                                              caplog):
    """A stopped stage keeps its connections open. Every stage answers the heartbeat's stats
    request on its event loop, beside the compute: a chain whose stage 3 reads nothing more
    (its upstream connection paused, as a SIGSTOPped process) is dropped after
    STAGE_SILENCE_S, naming stage 3, its session ends, and the chain rebuilt serves the exact
    output; forwards far longer than the silence (emulated device time) are no hang."""
    from specctl.pipeline import decoder as decoder_module

    monkeypatch.setattr(decoder_module, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(decoder_module, "STAGE_SILENCE_S", 0.4)
    monkeypatch.setattr(decoder_module, "FORWARD_TIMEOUT_S", 20.0)  # the old bound, out of this test's way
    target, _ = models
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    reference = generate(target.decoder, PROMPTS[1], params)[0]
    async with LocalPipeline(target, 3, delay_s=1.0) as pipeline:  # each forward: 1 s > the silence
        staged = pipeline.staged
        short = SamplingParams(max_tokens=2, ignore_eos=True)
        assert (await asyncio.to_thread(generate, staged.decoder, PROMPTS[1], short))[0] == reference[:2]
        assert pipeline.client.reconnects == 0
        staged.decoder.delay_s = 0.0
        for server in pipeline.servers:
            server.config.delay_s = 0.0
        last = pipeline.servers[-1]
        for writer in list(last._live._tasks.values()):  # stage 3 stops reading: nothing more comes
            writer.transport.pause_reading()
        with pytest.raises(StageUnavailable, match=r"^the pipeline chain broke \(stage 3 has not answered for 0\.4 s: "
                                                   r"stopped or hung\): the session cannot go on; retry$"):
            await asyncio.to_thread(generate, staged.decoder, PROMPTS[1], params)
        assert "pipeline stage 3 has not answered for 0.4 s: dropping the chain" in caplog.text
        await wait_until(lambda: pipeline.client.connected.is_set() and pipeline.client.reconnects == 1,
                         what="the chain rebuilt")
        assert (await asyncio.to_thread(generate, staged.decoder, PROMPTS[1], params))[0] == reference
        await wait_until(lambda: pipeline.servers[0].pool.sessions == 0, what="stage 2 freed the dropped chain")


async def test_a_missing_next_stage_is_named_with_its_address_and_why():
    from specctl.bench.processes import free_port
    from specctl.pipeline.decoder import PipelineClient
    from specctl.pipeline.link import StageLink

    port = free_port()  # nothing listens there
    client = PipelineClient(lambda on_reply: StageLink("127.0.0.1", port, model="m", fingerprint="f",
                                                       on_reply=on_reply))
    first = asyncio.get_running_loop().create_future()
    runner = asyncio.create_task(client.run(first))
    try:
        assert await first is False
        assert client.last_error == f"stage 127.0.0.1:{port}: connection refused"
        with pytest.raises(StageUnavailable, match=rf"^the pipeline is down \(stage 127\.0\.0\.1:"
                                                   rf"{port}: connection refused\); retry later$"):
            client._check(client.epoch)
    finally:
        runner.cancel()


async def test_a_forward_left_unanswered_ends_its_session_alone_while_the_stages_answer(monkeypatch):
    """Past FORWARD_TIMEOUT_S a session's forward ends that session (StageUnavailable); a chain
    whose stages answer the heartbeat is no hung one, so it is kept for the other sessions."""
    import torch

    from specctl.net.protocol import Stats
    from specctl.pipeline import decoder as decoder_module
    from specctl.pipeline.decoder import PipelineClient

    monkeypatch.setattr(decoder_module, "FORWARD_TIMEOUT_S", 0.2)
    monkeypatch.setattr(decoder_module, "HEARTBEAT_S", 0.02)
    monkeypatch.setattr(decoder_module, "STAGE_SILENCE_S", 0.1)
    links = []

    class StatsOnlyLink:  # takes every frame, answers stats only
        address = "127.0.0.1:1"

        def __init__(self, on_reply):
            self.closed, self.error, self.posted, self.on_reply = asyncio.Event(), None, [], on_reply
            links.append(self)

        async def connect(self):
            pass

        def post(self, message):
            self.posted.append(message)
            if message == StatsRequest():
                self.on_reply(Stats("stage", {"stage": "2/2"}))

        def give_up(self, error):
            self.error = error
            self.closed.set()

        async def close(self):
            self.closed.set()

    client = PipelineClient(StatsOnlyLink)
    first = asyncio.get_running_loop().create_future()
    runner = asyncio.create_task(client.run(first))
    try:
        assert await first
        with pytest.raises(StageUnavailable, match=r"^the pipeline did not answer this session's forward within "
                                                   r"0\.2 s while its stages answer; retry$"):
            await asyncio.to_thread(lambda: decoder_module.wait_output(
                client.submit(client.epoch, lambda fid: ("forward", fid)), torch.device("cpu")))
        assert [message for message in links[0].posted if message != StatsRequest()] == [("forward", 1)]
        await asyncio.sleep(0.3)  # past the silence: the stages answered all along
        assert client.epoch == 1 and client.connected.is_set() and not links[0].closed.is_set()
        assert len(links) == 1 and links[0].posted.count(StatsRequest()) > 5
        assert client._pending == {}  # the given-up forward is not kept for an output that never comes
        late = client.submit(client.epoch, lambda fid: ("forward", fid))
        await asyncio.sleep(0.05)
        late.cancel()
        client._on_reply(StageOutput(2, Tensor.from_torch(torch.zeros(1))))  # answered as it was given up
        assert late.cancelled() and client._pending == {}
    finally:
        runner.cancel()


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe"])
async def test_a_split_target_of_another_family_outputs_exactly_the_whole_target(tiny_dir, arch):
    """Per-layer facts travel with the stage's layer range: Gemma 3's windows (passed by these
    prompts) and its sliding layers' own RoPE, Qwen3-MoE's sparse layers, on three stages."""
    target = load_model("t", tiny_dir[arch], "fp32")
    draft = load_model("d", tiny_dir[f"{arch}-draft"], "fp32")
    async with LocalPipeline(target, 3) as pipeline:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        for mode in ("ar", "tree"):
            for prompt in PROMPTS:
                reference = generate(target.decoder, prompt, params, _drafter(mode, draft))[0]
                tokens, _, _ = await asyncio.to_thread(generate, pipeline.staged.decoder, prompt, params,
                                                       _drafter(mode, draft))
                assert tokens == reference, (arch, mode, prompt)
