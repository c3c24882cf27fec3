"""SpecPipe with its tree levels drafted by a draft server (`verify --stage 1/n --draft H:P
--specpipe`): exact against the whole target, the draft's level sessions freed, the
draft server gone mid-session (plain PP from then on, the same tokens), bad level
requests refused with a clear error."""

import asyncio
import logging
from dataclasses import replace

import pytest
import regex

from specctl.draft.levels import LevelTable
from specctl.draft.server import DraftServer, DraftServerConfig
from specctl.engine.kv_cache import KVPool
from specctl.engine.loader import load_model
from specctl.errors import BadRequest
from specctl.net.framing import read_message, write_message
from specctl.net.handshake import client_handshake
from specctl.net.protocol import (Cancel, Done, Error, Generate, Graft, Level, NextLevel, OpenLevels, Reroot,
                                   SessionOpened, Tokens)
from specctl.pipeline.local import LocalPipeline
from specctl.pipeline.serve import SpecPipeDraft
from specctl.pipeline.specpipe import specpipe_generate
from specctl.pipeline.token_source import TreeShape
from specctl.spec.drafters import ModelChainDrafter
from specctl.spec.rounds import generate
from specctl.spec.params import SamplingParams
from specctl.verify.client import remote_generate, remote_stats
from specctl.verify.draft_client import DraftClient
from specctl.verify.server import TargetServer, TargetServerConfig
from tests.conftest import wait_until

PROMPTS = [[5, 9, 13, 2], [7, 8, 9, 10, 7, 8, 9], [42, 43, 44, 45, 46]]


@pytest.fixture(scope="module")
def models(tiny_dir):
    return load_model("t", tiny_dir["llama"], "fp32"), load_model("d", tiny_dir["llama"], "fp32", num_layers=2)


class RemoteSpecPipe:
    """A draft server, a target split over ``stages`` loopback stages and stage 1 serving
    SpecPipe with the draft server's levels."""

    def __init__(self, models, stages: int, shape: TreeShape, draft_here: bool = False, max_sessions: int = 16,
                 delay_s: float = 0.0) -> None:
        self.models, self.stages, self.shape, self.delay_s = models, stages, shape, delay_s  # delay_s: each stage's
        self.draft_here = draft_here  # the draft in stage 1's process (--specpipe-draft), no draft server
        self.max_sessions = max_sessions  # the draft server's

    async def __aenter__(self) -> "RemoteSpecPipe":
        target, draft = self.models
        self.pipeline = LocalPipeline(target, self.stages, delay_s=self.delay_s)
        staged = await self.pipeline.start()
        self.draft = self.client = self.link = None
        if self.draft_here:
            specpipe = SpecPipeDraft.local(draft.decoder, self.shape, "draft here")
        else:
            self.draft_port = draft_port = await self.start_draft(0)
            self.client = DraftClient("127.0.0.1", draft_port, model=target.name,
                                      fingerprint=target.vocab_fingerprint)
            first = asyncio.get_running_loop().create_future()
            self.link = asyncio.create_task(self.client.run(first))
            assert await first
            specpipe = SpecPipeDraft.remote(self.client, asyncio.get_running_loop(), self.shape, "draft server")
        self.target = TargetServer(staged, TargetServerConfig(port=0), self.client, pipeline=self.pipeline.client,
                                   specpipe=specpipe)
        self.port = await self.target.start()
        return self

    async def start_draft(self, port: int) -> int:
        """A draft server on ``port`` (0: any), as ``self.draft``."""
        draft = self.models[1]
        self.draft = DraftServer(draft, ModelChainDrafter(draft.decoder, 3),
                                 DraftServerConfig(port=port, max_sessions=self.max_sessions))
        return await self.draft.start()

    async def __aexit__(self, *exc) -> None:
        await self.target.close()
        if self.link is not None:
            self.link.cancel()
            await asyncio.gather(self.link, return_exceptions=True)
        await self.pipeline.close()
        if self.draft is not None:
            await self.draft.close()


@pytest.mark.parametrize("stages, width, spread", [(2, 3, "likeliest"), (3, 1, "likeliest"), (4, 4, "likeliest"),
                                                   (3, 3, "every-node")])
async def test_levels_from_a_draft_server_give_exactly_the_whole_targets_tokens(models, stages, width, spread):
    target, _ = models
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    async with RemoteSpecPipe(models, stages, TreeShape(width, 2, spread)) as cluster:
        for prompt in PROMPTS:
            tokens, reason, stats = await remote_generate("127.0.0.1", cluster.port, prompt, params)
            assert tokens == generate(target.decoder, prompt, params)[0] and reason == "length", prompt
        served = await remote_stats("127.0.0.1", cluster.port)
        assert served["specpipe_steps"] == 3 * 32 and served["specpipe_hits"] > 0 and served["specpipe_draft_lost"] == 0
        # The same tree as a draft in stage 1's process grows: the same hits.
        local = [await asyncio.to_thread(specpipe_generate, cluster.pipeline.staged.decoder, models[1].decoder, prompt,
                                         params, TreeShape(width, 2, spread)) for prompt in PROMPTS]
        assert served["specpipe_hits"] == sum(run[3].hits for run in local)
        assert cluster.draft.levels.levels_sent > 0
        await wait_until(lambda: not cluster.draft.levels.sessions, what="the draft's level sessions freed")
        await wait_until(lambda: all(s.pool.sessions == 0 for s in cluster.pipeline.servers), what="stage KV freed")


async def test_the_draft_server_gone_mid_session_leaves_plain_pipelining_with_the_same_tokens(models):
    target, _ = models
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    reference = generate(target.decoder, PROMPTS[1], params)[0]
    async with RemoteSpecPipe(models, 3, TreeShape(2, 2)) as cluster:
        seen = asyncio.Event()

        def on_tokens(tokens):
            if cluster.draft.levels.levels_sent >= 5:
                seen.set()
        running = asyncio.create_task(remote_generate("127.0.0.1", cluster.port, PROMPTS[1], params, on_tokens))
        await asyncio.wait_for(seen.wait(), 60)
        await cluster.draft.close()  # the draft server goes away mid-session
        tokens, reason, _ = await running
        assert tokens == reference and reason == "length"
        served = await remote_stats("127.0.0.1", cluster.port)
        assert served["specpipe_draft_lost"] == 1 and served["specpipe_hits"] > 0
        # The next session starts without a draft (none is there) and is exact too.
        tokens, _, _ = await remote_generate("127.0.0.1", cluster.port, PROMPTS[0], params)
        assert tokens == generate(target.decoder, PROMPTS[0], params)[0]


async def exact_until(cluster: RemoteSpecPipe, prompt: list[int], condition) -> dict:
    """A greedy session on ``cluster`` of up to 480 tokens, cancelled once ``condition()`` holds
    (checked as tokens come): its tokens are the whole target's; returns stage 1's stats after it."""
    tokens = await generate_until(cluster.port, prompt, 480, condition)
    assert len(tokens) < 480
    assert tokens == generate(cluster.models[0].decoder, prompt, SamplingParams(max_tokens=len(tokens),
                                                                                 ignore_eos=True))[0]
    await wait_until(lambda: cluster.target.pool.used_bytes == 0, what="the cancelled session's driver ended")
    return await remote_stats("127.0.0.1", cluster.port)


async def generate_until(port: int, prompt: list[int], max_tokens: int, condition) -> list[int]:
    """A greedy session's tokens, cancelled once ``condition()`` holds (checked as they come)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await client_handshake(reader, writer, role="client")
    await write_message(writer, Generate(1, prompt, max_tokens, ignore_eos=True))
    tokens, cancelled = [], False
    while isinstance(reply := await read_message(reader), Tokens):
        tokens += reply.tokens
        if not cancelled and condition():
            await write_message(writer, Cancel(1))
            cancelled = True
    writer.close()
    assert isinstance(reply, Done) and reply.finish_reason == "cancelled", reply
    return tokens


async def test_a_session_a_full_draft_server_refused_drafts_levels_once_there_is_room(models, monkeypatch, caplog):
    """A refusal for room (another target's session fills the server) leaves plain PP for a
    while, not for the session's life: at a flush past REOPEN_AFTER_S stage 1 asks again, and
    the levels come once the other session ends. No warning: a full server is no fault."""
    monkeypatch.setattr("specctl.verify.draft_client.REOPEN_AFTER_S", 0.05)
    async with RemoteSpecPipe(models, 2, TreeShape(2, 2), max_sessions=1) as cluster:
        holder = await cluster.client.open([3, 4, 5], temperature=0.0, top_p=1.0, top_k=0, seed=0, max_tokens=8)
        assert isinstance(holder, tuple)  # another session has the server's one place
        caplog.set_level(logging.DEBUG, logger="specctl")

        closed = []

        def room_then_levels() -> bool:
            if cluster.draft.table.states and not closed:  # once: a second CLOSE of its tag would be unknown
                cluster.client.close(holder)  # the other session ends
                closed.append(holder)
            return cluster.draft.levels.levels_sent >= 30

        served = await exact_until(cluster, PROMPTS[1], room_then_levels)
        assert (served["specpipe_draft_lost"], served["specpipe_draft_reopened"]) == (1, 1)
        assert served["specpipe_hits"] > 0
        went = [r for r in caplog.records if "SpecPipe's draft went away" in r.getMessage()]
        assert [r.levelno for r in went] == [logging.DEBUG] and "draft server full: 1 sessions open" in went[0].getMessage()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        await wait_until(lambda: not cluster.draft.levels.sessions, what="the level session freed")


async def test_a_draft_server_back_on_its_port_drafts_levels_for_a_session_running_without_it(models, caplog):
    """The draft server goes away mid-session and comes back: the link reconnects and the
    session, plain PP meanwhile, opens a level session on the new server at its next flush."""
    # 480 steps of at least 4 ms a stage: seconds, for a reconnection that takes a fraction of one
    async with RemoteSpecPipe(models, 2, TreeShape(2, 2), delay_s=0.004) as cluster:
        caplog.set_level(logging.INFO, logger="specctl")
        phase, port = ["first"], cluster.draft_port

        def restart_then_levels() -> bool:
            if phase[0] == "first" and cluster.draft.levels.levels_sent >= 3:
                phase[0] = "closing"
                asyncio.ensure_future(restart())
            return phase[0] == "back" and cluster.draft.levels.levels_sent >= 3

        async def restart() -> None:
            await cluster.draft.close()
            await wait_until(lambda: not cluster.client.connected.is_set(), what="the link lost")
            await cluster.start_draft(port)
            phase[0] = "back"

        served = await exact_until(cluster, PROMPTS[0], restart_then_levels)
        assert (served["specpipe_draft_lost"], served["specpipe_draft_reopened"]) == (1, 1)
        back = [r.getMessage() for r in caplog.records if "SpecPipe's draft is back" in r.getMessage()]
        assert len(back) == 1 and "(was: no level from the draft server" in back[0]
        await wait_until(lambda: not cluster.draft.levels.sessions, what="the new server's level session freed")


async def test_a_resumed_sessions_levels_count_its_resumed_tokens_as_output(models):
    """A generation resumed on a SpecPipe target (GENERATE's resumed output): the draft
    server's level guide counts those tokens as output, as stage 1's session does, so a
    presence penalty (output only) shapes its levels as a draft here shapes them: the same hits."""
    from specctl.verify.client import TargetConnection

    target, draft = models
    params = SamplingParams(max_tokens=40, ignore_eos=True, presence_penalty=1.5)
    whole = generate(target.decoder, PROMPTS[1], params)[0]
    async with RemoteSpecPipe(models, 2, TreeShape(3, 2)) as cluster:
        connection = await TargetConnection("127.0.0.1", cluster.port).connect()
        try:
            stream = connection.generate(PROMPTS[1], params, resumed=whole[:12])
            tokens = []
            while not isinstance(event := await stream.next(), Done):
                tokens += event.tokens
        finally:
            connection.close()
        assert tokens == whole[12:]
        local = await asyncio.to_thread(specpipe_generate, cluster.pipeline.staged.decoder, draft.decoder, PROMPTS[1],
                                        params, TreeShape(3, 2), resumed=tuple(whole[:12]))
        assert local[0] == whole
        served = await remote_stats("127.0.0.1", cluster.port)
        assert served["specpipe_steps"] == 28 and served["specpipe_hits"] == local[3].hits


async def test_a_specpipe_target_says_once_that_the_prompt_is_read_before_its_first_token_when_asked(models):
    """llama.cpp's return_progress on a SpecPipe target: the prompt goes through the stages in
    one forward, so one PROMPT_PROGRESS (the whole prompt) comes before the first TOKENS; the
    tokens are the same as unasked, and the prompt is counted in the target's prefill stats only
    while it is read."""
    from specctl.net.protocol import PromptProgress
    from specctl.verify.client import TargetConnection

    target, _ = models
    prompt = [(7 * i + 3) % 200 + 1 for i in range(29)]
    async with RemoteSpecPipe(models, 2, TreeShape(2, 2)) as cluster:
        connection = await TargetConnection("127.0.0.1", cluster.port).connect()
        try:
            runs = {}
            for asked in (True, False):
                stream = connection.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True,
                                                                    prompt_progress=asked))
                runs[asked] = [await stream.next()]
                while not isinstance(runs[asked][-1], Done):
                    runs[asked].append(await stream.next())
        finally:
            connection.close()
        asked, plain = runs[True], runs[False]
        assert isinstance(asked[0], PromptProgress) and isinstance(asked[1], Tokens)
        assert (asked[0].total, asked[0].cache, asked[0].processed) == (29, 0, 29) and asked[0].time_ms > 0
        assert [type(m) for m in asked[1:]] == [type(m) for m in asked[1:] if not isinstance(m, PromptProgress)]
        assert not any(isinstance(m, PromptProgress) for m in plain)
        tokens = lambda messages: [t for m in messages if isinstance(m, Tokens) for t in m.tokens]  # noqa: E731
        assert tokens(asked) == tokens(plain) == generate(target.decoder, prompt, SamplingParams(
            max_tokens=12, ignore_eos=True))[0]
        served = await remote_stats("127.0.0.1", cluster.port)
        assert (served["prefill_sessions"], served["prefill_tokens_left"]) == (0, 0)
        assert cluster.target.prefills.sessions == {}


@pytest.mark.parametrize("draft_here", [False, True], ids=["draft-server", "draft-here"])
async def test_a_requests_prediction_is_grafted_onto_the_tree_exactly_and_mirrored_on_the_draft_server(
        models, draft_here):
    """A Predicted Output's stretches go through the stages as chains grafted onto SpecPipe's
    tree, the draft server hanging the same chains (Graft): the same hits as a draft in stage
    1's process; the rest of the answer is SpecPipe's levels."""
    target, draft = models
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    alone = generate(target.decoder, PROMPTS[1], params)[0]
    prediction = tuple(alone[:24]) + (1, 2, 3)  # the first 24 tokens, then an edit: the draft's levels after it
    predicted = replace(params, prediction=prediction)
    async with RemoteSpecPipe(models, 3, TreeShape(3, 2), draft_here) as cluster:
        tokens, reason, stats = await remote_generate("127.0.0.1", cluster.port, PROMPTS[1], predicted)
        assert tokens == alone and reason == "length"
        assert stats["prediction_accepted"] >= 20 and stats["rounds"] == 59  # a decision a token, chains or levels
        served = await remote_stats("127.0.0.1", cluster.port)
        assert served["specpipe_steps"] == 60 and served["prediction_accepted"] == stats["prediction_accepted"]
        local = await asyncio.to_thread(specpipe_generate, cluster.pipeline.staged.decoder, draft.decoder, PROMPTS[1],
                                        predicted, TreeShape(3, 2))
        assert (served["specpipe_hits"], served["prediction_accepted"]) == (local[3].hits, local[3].predicted_accepted)
        assert served["specpipe_predicted"] == local[3].predicted > 0
        if not draft_here:  # the chains hung on the draft server's tree too, its levels grown under them
            assert cluster.draft.levels.grafts > 0 and cluster.draft.levels.levels_sent > 0
            assert (await remote_stats("127.0.0.1", cluster.draft_port))["level_grafts"] == cluster.draft.levels.grafts
            assert cluster.draft.proposals_sent == 0
        tokens, _, _ = await remote_generate("127.0.0.1", cluster.port, PROMPTS[1], params)
        assert tokens == alone and (await remote_stats("127.0.0.1", cluster.port))["specpipe_steps"] == 120
        await wait_until(lambda: all(s.pool.sessions == 0 for s in cluster.pipeline.servers), what="stage KV freed")
        await wait_until(lambda: cluster.target.pool.used_bytes == 0, what="stage 1's KV (the draft's too) freed")
        if not draft_here:
            await wait_until(lambda: not cluster.draft.table.states and not cluster.draft.levels.sessions,
                             what="the draft server's sessions freed")


async def test_a_cancelled_predicted_session_counts_what_it_verified_in_the_servers_totals(models):
    target, _ = models
    alone = generate(target.decoder, PROMPTS[1], SamplingParams(max_tokens=300, ignore_eos=True))[0]
    async with RemoteSpecPipe(models, 2, TreeShape(3, 2), draft_here=True) as cluster:
        reader, writer = await asyncio.open_connection("127.0.0.1", cluster.port)
        await client_handshake(reader, writer, role="client")
        # the prediction right for 60 tokens, then an edit: one token a step from there, so the
        # CANCEL lands long before the 300th token
        await write_message(writer, Generate(1, PROMPTS[1], 300, ignore_eos=True, prediction=alone[:60] + [1, 2, 3]))
        tokens = (await read_message(reader)).tokens
        while len(tokens) < 30:
            tokens += (await read_message(reader)).tokens
        await write_message(writer, Cancel(1))
        while isinstance(reply := await read_message(reader), Tokens):
            tokens += reply.tokens
        assert isinstance(reply, Done) and reply.finish_reason == "cancelled" and tokens == alone[:len(tokens)]
        assert reply.stats["prediction_accepted"] >= 29
        writer.close()
        await wait_until(lambda: cluster.target.pool.used_bytes == 0, what="stage 1's KV freed")
        # the step in progress at the cancel ran on: the server counts it too, once its driver ended
        served = await remote_stats("127.0.0.1", cluster.port)
        piped = cluster.target.specpipe.totals
        assert served["prediction_accepted"] == piped.predicted_accepted >= reply.stats["prediction_accepted"]
        assert served["prediction_rejected"] == piped.predicted_rejected >= reply.stats["prediction_rejected"]


def test_level_table_refuses_what_does_not_fit_its_tree(models):
    _, draft = models
    table = LevelTable(draft.decoder, KVPool(None), draft.spec.vocab_size, draft.spec.max_position)
    with pytest.raises(BadRequest, match="width must be in 1..256"):
        table.open(1, OpenLevels(0, [5, 9], width=0, topk=2, capacity=64))
    with pytest.raises(BadRequest, match=r"^spread must be one of likeliest, every-node, got 'wide'$"):
        table.open(1, OpenLevels(0, [5, 9], width=2, topk=2, capacity=64, spread="wide"))
    with pytest.raises(BadRequest, match="token ids must be in"):
        table.open(1, OpenLevels(0, [5, 10**6], width=2, topk=2, capacity=64))
    with pytest.raises(BadRequest, match="a capacity above its text.s length"):
        table.open(1, OpenLevels(0, [5, 9], width=2, topk=2, capacity=2))
    table.open(1, OpenLevels(0, [5, 9, 13], width=2, topk=2, capacity=64))
    table.reroot(Reroot(1, -1, -1, 2, 3))  # the first tree: root token 2 at position 3
    level = table.next_level(1, [0])
    assert level.nodes == [1, 2] and level.parents == [0, 0] and len(set(level.tokens)) == 2
    with pytest.raises(BadRequest, match="names nodes the session's tree does not hold"):
        table.next_level(1, [7])
    with pytest.raises(BadRequest, match="unknown level session 9"):
        table.next_level(9, [0])
    table.open(2, OpenLevels(0, [], width=2, topk=2, capacity=64))  # a one-token prompt: nothing before the root
    table.reroot(Reroot(2, -1, -1, 5, 0))
    assert table.next_level(2, [0]).nodes == [1, 2]
    table.graft(Graft(2, 1, [7, 8]))  # a predicted chain under node 1: nodes 3 and 4, as stage 1 numbers them
    level = table.next_level(2, [4])
    assert level.nodes == [5, 6] and level.parents == [4, 4]
    assert table.sessions[2].levels.mirror.order == [0, 1, 3, 4]  # the chain read with the frontier, node 1 first
    table.open(3, OpenLevels(0, [5], width=2, topk=2, capacity=8))
    table.reroot(Reroot(3, -1, -1, 2, 1))
    table.graft(Graft(3, 0, [7] * 7))  # positions 2..8: past the capacity of 8
    with pytest.raises(BadRequest, match="^a chain of 7 tokens under node 0: the tree does not hold the node, a token "
                                         "is out of range, or it reaches past the session's capacity$"):
        table.next_level(3, [0])
    table.close(3)
    table.reroot(Reroot(1, 0, 42, 0, 4))  # a node it never had: the session says so on its next request
    with pytest.raises(BadRequest, match="re-rooting at 0 -> 42: nodes the tree does not hold"):
        table.next_level(1, [1, 2])
    table.close(1)
    table.close(2)
    assert not table.sessions and table.pool.sessions == 0


def test_a_level_session_follows_its_requests_rules_from_the_first_root_on(models):
    """OpenLevels carries the request's rules: the guide is built when the first root (the
    prompt's last token) comes, counts each re-rooting's token as output, and goes with the
    session; rules it cannot build (a grammar it cannot read) leave the levels free."""
    from functools import partial

    from specctl.spec.logit_rules import draft_guide

    _, draft = models
    guide_of = partial(draft_guide, tokenizer=draft.tokenizer, vocab_size=draft.spec.vocab_size,
                       stop_ids=set(draft.eos_token_ids), device=draft.decoder.device)
    table = LevelTable(draft.decoder, KVPool(None), draft.spec.vocab_size, draft.spec.max_position, guide_of)
    allowed = [40, 41, 42, 43]
    table.open(1, OpenLevels(0, [5, 9, 13], width=3, topk=2, capacity=64, allowed_token_ids=allowed,
                             repetition_penalty=1.5))
    assert table.sessions[1].levels.guide is None
    table.reroot(Reroot(1, -1, -1, 2, 3))
    guide = table.sessions[1].levels.guide
    assert guide is not None and guide.produced == 0 and bool(guide.in_prompt[[5, 9, 13, 2]].all())
    level = table.next_level(1, [0])
    assert set(level.tokens) <= set(allowed) and len(level.tokens) == 2  # topk children of the root
    table.reroot(Reroot(1, 0, level.nodes[0], level.tokens[0], 4))  # the draft's likeliest child verified
    assert guide.produced == 1
    assert set(table.next_level(1, [n for n in level.nodes if n in table.sessions[1].tree.nodes]).tokens) <= set(allowed)
    # a session opened after output (generated = 2): the root and the token before it count as output
    table.open(3, OpenLevels(0, [5, 9, 13], width=2, topk=2, capacity=64, repetition_penalty=1.5, generated=2))
    table.reroot(Reroot(3, -1, -1, 2, 3))
    resumed = table.sessions[3].levels.guide
    assert resumed.produced == 2 and resumed.counts[[13, 2]].tolist() == [1.0, 1.0]
    assert bool(resumed.in_prompt[[5, 9]].all()) and not bool(resumed.in_prompt[[13, 2]].any())
    table.close(3)
    table.open(2, OpenLevels(0, [5, 9], width=2, topk=2, capacity=64, structured_kind="json",
                             structured_spec="{not json"))
    table.reroot(Reroot(2, -1, -1, 7, 2))
    assert table.sessions[2].levels.guide is None and len(table.next_level(2, [0]).tokens) == 2
    table.close(1)
    table.close(2)
    assert not table.sessions and table.pool.sessions == 0


async def test_level_requests_over_the_wire_for_unknown_sessions_get_an_error(models):
    target, draft = models
    server = DraftServer(draft, ModelChainDrafter(draft.decoder, 3), DraftServerConfig(port=0))
    port = await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await client_handshake(reader, writer, role="target", model=target.name, fingerprint=target.vocab_fingerprint)
        await write_message(writer, NextLevel(77, [0]))
        reply = await read_message(reader)
        assert isinstance(reply, Error) and (reply.code, reply.tag) == ("unknown_tag", 77)
        await write_message(writer, OpenLevels(1, [5, 9, 13], 2, 2, 64))
        opened = await read_message(reader)
        assert isinstance(opened, SessionOpened)
        await write_message(writer, Reroot(opened.tag, -1, -1, 2, 3))
        await write_message(writer, NextLevel(opened.tag, [0]))
        level = await read_message(reader)
        assert isinstance(level, Level) and level.nodes == [1, 2]
        await write_message(writer, NextLevel(opened.tag, [5]))
        refused = await read_message(reader)
        assert isinstance(refused, Error) and refused.code == "bad_request" and "does not hold" in refused.message
        writer.close()
        await wait_until(lambda: not server.levels.sessions, what="a dropped connection's level sessions freed")
    finally:
        await server.close()


# Greedy requests whose logits a rule adjusts, and the log-probabilities asked for: stage 1
# decides each token from the root's row after the committed text, as AR's step does.
ADJUSTED = [
    SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2, prompt_logprobs=1),
    SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.6, presence_penalty=0.5,
                   logit_bias=((7, 4.0), (9, -100.0)), logprobs=0),
    SamplingParams(max_tokens=16, ignore_eos=True, allowed_token_ids=(3, 4, 17, 18, 40)),
    SamplingParams(max_tokens=16, ignore_eos=True, bad_words=((3,), (5, 5)), min_tokens=4),
    SamplingParams(max_tokens=16, ignore_eos=True, thinking_budget=3, thinking_markers=((20,), (21, 22))),
    SamplingParams(max_tokens=16, structured=("regex", "[ab]{3}c")),  # ends by the grammar: "stop" before 16
]


@pytest.mark.parametrize("params", ADJUSTED, ids=["logprobs", "penalties+bias", "allowed", "bad-words", "thinking",
                                                  "grammar"])
async def test_logit_rules_and_logprobs_through_a_specpipe_target_are_the_whole_targets(models, params):
    from specctl.spec.rounds import run_to_end

    target, _ = models
    steps = []
    async with RemoteSpecPipe(models, 2, TreeShape(2, 2)) as cluster:
        for prompt in ([20, 5, 9], PROMPTS[1]):  # the first opens a thought: its budget is counted from the prompt
            reference = run_to_end(target.decoder, prompt, params, eos_token_ids=target.eos_token_ids,
                                   tokenizer=target.tokenizer)
            scores = []
            steps.append(len(reference.output))  # a grammar that ends ends the output: no stop token decided
            tokens, reason, _ = await remote_generate("127.0.0.1", cluster.port, prompt, params,
                                                      on_scores=scores.append)
            assert tokens == reference.output and reason == reference.finish_reason, prompt
            if params.structured is not None:
                assert reason == "stop" and regex.fullmatch("[ab]{3}c", target.tokenizer.decode(tokens)), tokens
            else:
                assert reason == "length"
            got = [lp for event in scores for lp in event.logprobs]
            assert got == pytest.approx([entry[0] for entry in reference.logprobs], abs=1e-4)
            if params.logprobs:
                assert [ids for event in scores for ids in event.top_ids] == [e[1] for e in reference.logprobs]
            if params.prompt_logprobs is not None:
                assert scores[0].prompt_logprobs == pytest.approx([e[0] for e in reference.prompt_logprobs], abs=1e-4)
            if params.thinking_budget is not None and prompt[0] == 20:
                # the thought's 2 prompt tokens and 1 more, then its end, forced
                assert reference.output[1:3] == [21, 22] and 21 not in reference.output[:1]
        served = await remote_stats("127.0.0.1", cluster.port)
        assert served["specpipe_steps"] == sum(steps)
        # The draft server's levels follow the request's rules as a draft in stage 1's process does
        # (the session's own rules, read): the same trees, the same hits.
        local = [await asyncio.to_thread(specpipe_generate, cluster.pipeline.staged.decoder, models[1].decoder, prompt,
                                         params, TreeShape(2, 2), eos_token_ids=target.eos_token_ids,
                                         tokenizer=target.tokenizer) for prompt in ([20, 5, 9], PROMPTS[1])]
        assert served["specpipe_hits"] == sum(run[3].hits for run in local) > 0
