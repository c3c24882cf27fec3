"""Draft server and target instances over real TCP on loopback (in one process, so the
test can inspect their state): exactness, faults, isolation, auth and TLS."""

import asyncio
import logging
import re
import threading
import time

import pytest

from specctl.draft.server import DraftServer, DraftServerConfig
from specctl.engine.loader import load_model
from specctl.errors import VocabMismatch
from specctl.net.framing import read_message, write_message
from specctl.net.handshake import AuthError, client_handshake
from specctl.net.protocol import Cancel, CloseSession, Done, OpenLevels, Error, Generate, OpenSession, Propose, SessionOpened, Stats, StatsRequest, Tokens, decode, encode
from specctl.spec.rounds import generate
from specctl.spec.drafters import ModelChainDrafter, ModelTreeDrafter
from specctl.spec.params import SamplingParams
from specctl.spec.suffix import SuffixDrafter
from specctl.verify.client import remote_generate
from specctl.verify.draft_client import DraftClient
from specctl.verify.server import TargetServer, TargetServerConfig
from tests.conftest import self_signed_cert, wait_until

PROMPTS = [[5, 9, 13, 2], [7, 8, 9, 10, 7, 8, 9], [100], [42, 43, 44, 45, 46], [1, 2, 3, 1, 2, 3], [250, 3, 77]]


@pytest.fixture(scope="module")
def models(tiny_dir):
    target = load_model("tiny-llama", tiny_dir["llama"], "fp32")
    draft = load_model("tiny-llama@2", tiny_dir["llama"], "fp32", num_layers=2)
    return target, draft


async def start_star(models, drafter_kind="chain", auth_token=None, draft_ssl=None, client_ssl=None, port=0,
                     max_sessions=64, verify_delay_s=0.0):
    target, draft = models
    drafter = {"chain": lambda: ModelChainDrafter(draft.decoder, 3), "tree": lambda: ModelTreeDrafter(draft.decoder, 3, 2, 3),
               "suffix": lambda: SuffixDrafter(4)}[drafter_kind]()
    draft_server = DraftServer(draft, drafter, DraftServerConfig(port=port, auth_token=auth_token,
                                                                 max_sessions=max_sessions), draft_ssl)
    draft_port = await draft_server.start()
    client = DraftClient("127.0.0.1" if not client_ssl else "localhost", draft_port, model=target.name,
                         fingerprint=target.vocab_fingerprint, auth_token=auth_token, ssl=client_ssl)
    first = asyncio.get_running_loop().create_future()
    link = asyncio.create_task(client.run(first))
    assert await first
    target_server = TargetServer(target, TargetServerConfig(port=0, verify_delay_s=verify_delay_s), client)
    target_port = await target_server.start()
    return draft_server, draft_port, client, link, target_server, target_port


async def stop_star(draft_server, link, target_server):
    link.cancel()
    await target_server.close()
    await draft_server.close()


def local_reference(models, prompt, max_tokens):
    return generate(models[0].decoder, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]


@pytest.mark.parametrize("kind", ["chain", "tree"])
async def test_concurrent_sessions_over_tcp_equal_target_greedy(models, kind):
    draft_server, _, _, link, target_server, port = await start_star(models, kind)
    try:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        results = await asyncio.gather(*(remote_generate("127.0.0.1", port, p, params) for p in PROMPTS))
        for prompt, (tokens, reason, stats) in zip(PROMPTS, results):
            assert tokens == local_reference(models, prompt, 24)
            assert reason == "length"
            assert stats["rounds"] > 0
        assert target_server.snapshot()["rounds"] > 0 and target_server.totals.ar_rounds == 0
        assert draft_server.snapshot()["rounds"] > 0
        await wait_until(lambda: draft_server.table.states == {} and target_server.active == 0)
        assert draft_server.table.pool.used_bytes == 0 and target_server.pool.used_bytes == 0
    finally:
        await stop_star(draft_server, link, target_server)


async def test_a_suffix_draft_server_remembers_every_output_whole_its_last_round_too(models, tiny_dir):
    """`draft --mode suffix`: no draft weights (the model's vocabulary only); the star's outputs
    are the memory; the last round's tokens, which no proposal followed, reach the draft server
    with the session's close. SpecPipe's levels, which need a draft model, are refused."""
    vocabulary = load_model("tiny-llama", tiny_dir["llama"], weights=False)
    assert {p.device.type for p in vocabulary.decoder.parameters()} == {"meta"}
    assert vocabulary.vocab_fingerprint == models[0].vocab_fingerprint
    draft_server, draft_port, _, link, target_server, port = await start_star((models[0], vocabulary), "suffix")
    try:
        reader, writer = await _raw_target_connection(draft_port, vocabulary.vocab_fingerprint)
        await write_message(writer, OpenLevels(1, [1, 2, 3], 2, 2, 16))
        refused = await read_message(reader)
        assert (refused.code, refused.req, refused.message) == (
            "bad_request", 1, "this draft server drafts by suffix lookup and loaded no weights; SpecPipe's tree "
                              "levels need a draft model: run it with --mode tree")
        writer.close()
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        first = []
        for prompt in PROMPTS[:3]:
            tokens, _, stats = await remote_generate("127.0.0.1", port, prompt, params)
            first.append(stats["accepted"])
            assert tokens == local_reference(models, prompt, 24)
            await wait_until(lambda: draft_server.table.states == {})
            remembered = draft_server.table.drafter.outputs.sequences
            assert remembered[max(remembered)].tolist() == prompt[-1:] + tokens
        again, _, stats = await remote_generate("127.0.0.1", port, PROMPTS[0], params)
        assert again == local_reference(models, PROMPTS[0], 24)
        assert stats["accepted"] >= first[0] + 12  # drafted from its first run's output
    finally:
        await stop_star(draft_server, link, target_server)


async def test_draft_server_death_falls_back_then_reconnects(models, caplog):
    caplog.set_level(logging.INFO, logger="specctl.verify.draft")
    draft_server, draft_port, client, link, target_server, port = await start_star(models)
    try:
        params = SamplingParams(max_tokens=60, ignore_eos=True)
        seen = asyncio.Event()
        runs = [asyncio.create_task(remote_generate("127.0.0.1", port, p, params, lambda t: seen.set())) for p in PROMPTS[:4]]
        await seen.wait()
        await draft_server.close()  # the draft dies mid-stream
        results = await asyncio.gather(*runs)
        for prompt, (tokens, _, _) in zip(PROMPTS, results):
            assert tokens == local_reference(models, prompt, 60)
        assert target_server.totals.ar_rounds > 0
        # Restart on the same port: the target reconnects and speculation resumes.
        draft_server = DraftServer(models[1], ModelChainDrafter(models[1].decoder, 3), DraftServerConfig(port=draft_port))
        await draft_server.start()
        await asyncio.wait_for(client.connected.wait(), 20)
        before = draft_server.snapshot()["rounds"]
        tokens, _, _ = await remote_generate("127.0.0.1", port, PROMPTS[0], params)
        assert tokens == local_reference(models, PROMPTS[0], 60)
        assert draft_server.snapshot()["rounds"] > before
        messages = [r.getMessage() for r in caplog.records if r.name == "specctl.verify.draft"]
        lost = [m for m in messages if m.startswith("lost the draft server")]
        assert len(lost) == 1 and "decoding autoregressively and reconnecting" in lost[0]
        assert any(m.startswith("reconnected to the draft server") for m in messages)
    finally:
        await stop_star(draft_server, link, target_server)


async def _generating_client(port, prompt, max_tokens):
    """A raw client connection that has sent one GENERATE."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await client_handshake(reader, writer, role="client")
    await write_message(writer, Generate(1, prompt, max_tokens, ignore_eos=True))
    return reader, writer


async def test_client_disconnect_frees_state_everywhere(models):
    draft_server, _, _, link, target_server, port = await start_star(models)
    try:
        reader, writer = await _generating_client(port, [1, 2, 3], 400)
        assert isinstance(await read_message(reader), Tokens)
        await wait_until(lambda: target_server.active == 1 and len(draft_server.table.states) == 1)
        writer.close()
        await wait_until(lambda: target_server.active == 0 and draft_server.table.states == {})
        await wait_until(lambda: draft_server.table.pool.used_bytes == 0 and target_server.pool.used_bytes == 0)
    finally:
        await stop_star(draft_server, link, target_server)


async def test_cancel_ends_the_session_with_its_stats_and_the_connection_carries_on(models):
    draft_server, _, _, link, target_server, port = await start_star(models)
    try:
        reader, writer = await _generating_client(port, [1, 2, 3], 400)
        for _ in range(2):  # the prefill's token, then a round's
            assert isinstance(await read_message(reader), Tokens)
        await write_message(writer, Cancel(1))
        while isinstance(reply := await read_message(reader), Tokens):
            pass
        assert isinstance(reply, Done) and reply.req == 1 and reply.finish_reason == "cancelled"
        assert reply.stats["rounds"] >= 1 and reply.stats["drafted"] >= reply.stats["accepted"]
        await wait_until(lambda: target_server.active == 0 and draft_server.table.states == {})
        rejected = target_server.rejected_requests
        await write_message(writer, Cancel(1))  # nothing runs under that id any more
        assert await read_message(reader) == Error("unknown_request", "no running request 1", req=1)
        assert target_server.rejected_requests == rejected  # it ended: a CANCEL crossing its DONE is no fault
        await write_message(writer, Cancel(99))  # one that never ran is
        assert await read_message(reader) == Error("unknown_request", "no running request 99", req=99)
        assert target_server.rejected_requests == rejected + 1
        await write_message(writer, Generate(2, [1, 2, 3], 6, ignore_eos=True))
        tokens = []
        while isinstance(reply := await read_message(reader), Tokens):
            tokens += reply.tokens
        assert reply.finish_reason == "length" and tokens == local_reference(models, [1, 2, 3], 6)
        writer.close()
    finally:
        await stop_star(draft_server, link, target_server)


async def test_a_cancel_before_the_session_exists_gets_done_and_frees_its_cache(models):
    # The target's compute is busy, so the session's KV cache is still being set up when
    # CANCEL arrives: the client still gets DONE, and the cache made meanwhile is freed.
    draft_server, _, _, link, target_server, port = await start_star(models)
    try:
        gate = threading.Event()
        target_server.compute.submit_nowait(gate.wait, 30)
        reader, writer = await _generating_client(port, [1, 2, 3], 400)
        await wait_until(lambda: target_server.active == 1, what="the request reached the target")
        await write_message(writer, Cancel(1))
        reply = await asyncio.wait_for(read_message(reader), 5)
        gate.set()  # now the session's KV cache is made, and must be freed
        assert isinstance(reply, Done) and reply.req == 1 and reply.finish_reason == "cancelled"
        assert (reply.stats["prompt_tokens"], reply.stats["new_tokens"], reply.stats["rounds"]) == (3, 0, 0)
        await wait_until(lambda: target_server.pool.used_bytes == 0 and target_server.pool.sessions == 0
                         and target_server.active == 0 and draft_server.table.states == {})
        writer.close()
    finally:
        await stop_star(draft_server, link, target_server)


async def test_clients_leaving_during_the_prefill_leave_no_session_anywhere(models):
    # Closing right after GENERATE cancels the session while its prefill runs and its draft
    # session is being opened: both must still be freed (a draft tag once leaked here).
    draft_server, _, _, link, target_server, port = await start_star(models)
    try:
        for delay in (0.0, 0.001, 0.003, 0.01) * 5:
            _, writer = await _generating_client(port, list(range(1, 60)), 50)
            await asyncio.sleep(delay)
            writer.close()
        await wait_until(lambda: target_server.active == 0 and draft_server.table.states == {}
                         and draft_server.active_sessions == 0)
        await wait_until(lambda: draft_server.table.pool.used_bytes == 0 and target_server.pool.used_bytes == 0)
    finally:
        await stop_star(draft_server, link, target_server)


async def test_a_draft_session_whose_opener_gave_up_is_closed(models):
    draft_server, _, client, link, target_server, _ = await start_star(models)
    try:
        gate = threading.Event()  # the draft's compute is held: the open is surely in flight
        draft_server.compute.submit_nowait(gate.wait, 30)
        opening = asyncio.create_task(client.open([1, 2, 3], temperature=0.0, top_p=1.0, top_k=0, seed=1, max_tokens=8))
        await wait_until(lambda: draft_server.active_sessions == 1, what="the draft server has the OpenSession")
        opening.cancel()
        assert isinstance((await asyncio.gather(opening, return_exceptions=True))[0], asyncio.CancelledError)
        gate.set()  # now it opens the session, answers, and the client closes what nobody waits for
        await wait_until(lambda: draft_server.active_sessions == 0 and draft_server.table.states == {}
                         and draft_server.compute.queue_depth == 0, what="the draft session closed")
        assert draft_server.table.snapshot()["sessions"] == 0
    finally:
        await stop_star(draft_server, link, target_server)


async def test_an_opener_cancelled_as_its_reply_arrives_closes_the_session():
    """wait_for returns a reply that arrived in the same loop step as the cancellation:
    the opener must still end cancelled, and close the session it was given."""
    class Recorder:
        frames: list = []

        def write(self, frame):
            self.frames.append(decode(frame[4:]))

    client = DraftClient("127.0.0.1", 9, model="m", fingerprint="f")
    client._writer, client.epoch = Recorder(), 1
    opening = asyncio.create_task(client.open([1, 2], temperature=0.0, top_p=1.0, top_k=0, seed=1, max_tokens=4))
    await wait_until(lambda: client._pending, what="the OpenSession is sent")
    (future,) = client._pending.values()
    future.set_result(SessionOpened(1, 77))
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    assert [type(m).__name__ for m in Recorder.frames] == ["OpenSession", "CloseSession"]
    assert Recorder.frames[1].tag == 77


async def test_a_draft_server_that_stops_answering_is_dropped_and_the_client_reconnects(caplog, monkeypatch):
    """A hung draft server keeps its connection open: a proposal past the client's timeout, when
    a stats request gets no answer either, drops the link (every session then decodes
    autoregressively at once, no session waits the timeout out again) and the client
    reconnects; a caller's own deadline (a fused round's shorter one, a first proposal's longer
    one) drops nothing."""
    from specctl.net.handshake import server_handshake
    from specctl.net.protocol import Propose
    from specctl.verify import draft_client as draft_client_module

    monkeypatch.setattr(draft_client_module, "PROBE_S", 0.2)

    async def silent(reader, writer):  # shakes hands, then reads and never answers
        await server_handshake(reader, writer, role="draft", model="m", fingerprint="f", max_sessions=4,
                               auth_token=None, accept_roles={"target": True})
        while await reader.read(1 << 16):
            pass
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    client = DraftClient("127.0.0.1", server.sockets[0].getsockname()[1], model="m", fingerprint="f", timeout_s=0.3)
    running = asyncio.create_task(client.run())
    try:
        await wait_until(lambda: client.epoch == 1 and client.connected.is_set(), what="connected")
        assert await client._request(("tag", 5), Propose(5, [], [1]), timeout_s=0.1) is None  # a fused deadline
        # a first proposal's longer deadline (its prompt's prefill may queue behind other sessions')
        assert await client._request(("tag", 4), Propose(4, [], [1]), timeout_s=0.5) is None
        assert client.epoch == 1 and client._writer is not None
        assert await client._request(("tag", 6), Propose(6, [], [1])) is None  # the client's own timeout
        assert client._writer is None  # at once: the next request does not wait
        assert await asyncio.wait_for(client._request(("tag", 7), Propose(7, [], [1])), 0.05) is None
        await wait_until(lambda: client.epoch == 2 and client.connected.is_set(), what="reconnected")
        assert ("the draft server at 127.0.0.1:%d gave no answer within 0.3 s, nor to a stats request within 0.2 s; "
                "dropping the link" % client.port) in caplog.text
        # the loss says why it was dropped (the read loop ended on the closed link: not the reason)
        assert ("lost the draft server at 127.0.0.1:%d (no answer within 0.3 s, nor to a stats request within 0.2 s); "
                "decoding autoregressively and reconnecting" % client.port) in caplog.text
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        server.close()


async def test_a_draft_server_that_is_slow_but_answers_keeps_its_link(caplog):
    """A draft server swamped with long prompts leaves a proposal past the client's timeout but
    still answers (a stats request, on its event loop): that session's round goes without a
    proposal, and the link, with every other session's draft state, is kept."""
    from specctl.net.framing import read_message
    from specctl.net.handshake import server_handshake
    from specctl.net.protocol import Propose, Stats, StatsRequest, encode

    asked = []

    async def swamped(reader, writer):  # answers stats at once, proposals never
        await server_handshake(reader, writer, role="draft", model="m", fingerprint="f", max_sessions=4,
                               auth_token=None, accept_roles={"target": True})
        try:
            while True:
                message = await read_message(reader)
                asked.append(type(message).__name__)
                if isinstance(message, StatsRequest):
                    writer.write(encode(Stats("draft", {})))
        except asyncio.IncompleteReadError:
            writer.close()

    caplog.set_level(logging.INFO, logger="specctl.verify.draft")
    server = await asyncio.start_server(swamped, "127.0.0.1", 0)
    client = DraftClient("127.0.0.1", server.sockets[0].getsockname()[1], model="m", fingerprint="f", timeout_s=0.3)
    running = asyncio.create_task(client.run())
    try:
        await wait_until(lambda: client.epoch == 1 and client.connected.is_set(), what="connected")
        late = await asyncio.gather(*(client._request(("tag", tag), Propose(tag, [], [1])) for tag in (1, 2, 3)))
        assert late == [None, None, None]  # those rounds go without a proposal
        assert client.epoch == 1 and client._writer is not None  # the link stays
        assert asked == ["Propose", "Propose", "Propose", "StatsRequest"]  # one probe for the three
        assert ("the draft server at 127.0.0.1:%d is slow (a request past 0.3 s) but answers: keeping the link"
                % client.port) in caplog.text
        assert "dropping the link" not in caplog.text
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        server.close()


async def _raw_target_connection(port, fingerprint, auth=None):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await client_handshake(reader, writer, role="target", fingerprint=fingerprint, auth_token=auth)
    return reader, writer


async def test_bad_frames_unknown_and_foreign_tags(models):
    target, draft = models
    server = DraftServer(draft, ModelChainDrafter(draft.decoder, 3), DraftServerConfig(port=0))
    port = await server.start()
    try:
        a = await _raw_target_connection(port, target.vocab_fingerprint)
        b = await _raw_target_connection(port, target.vocab_fingerprint)
        await write_message(a[1], OpenSession(1, [1, 2, 3]))
        opened = await read_message(a[0])
        assert isinstance(opened, SessionOpened)
        # B cannot touch A's tag; unknown tags get an error; both connections stay usable.
        await write_message(b[1], Propose(opened.tag, [], [4]))
        reply = await read_message(b[0])
        assert isinstance(reply, Error) and reply.code == "unknown_tag" and reply.tag == opened.tag
        await write_message(a[1], Propose(9999, [], [4]))
        assert (await read_message(a[0])).code == "unknown_tag"
        await write_message(a[1], OpenSession(2, [1, 99999]))
        bad = await read_message(a[0])
        assert bad.code == "bad_request" and "token ids must be in [0, 320)" in bad.message
        # A malformed frame closes only B.
        b[1].write((5).to_bytes(4, "big") + b"\xc1\xc1\xc1\xc1\xc1")
        error = await read_message(b[0])
        assert error.code == "protocol" and "malformed frame" in error.message
        assert await b[0].read() == b""
        # An oversized length prefix closes a fresh connection the same way.
        c = await _raw_target_connection(port, target.vocab_fingerprint)
        c[1].write((1 << 30).to_bytes(4, "big"))
        assert "exceeds the limit" in (await read_message(c[0])).message
        # A still works.
        await write_message(a[1], Propose(opened.tag, [], [4]))
        assert (await read_message(a[0])).tag == opened.tag
        # A close whose last tokens are not token ids closes all the same, with an error saying so.
        await write_message(a[1], CloseSession(opened.tag, [3, 99999]))
        closing = await read_message(a[0])
        assert (closing.code, closing.tag, closing.message) == (
            "bad_request", opened.tag,
            "a closing session's tokens must be in [0, 320), got 3..99999; the session is closed without them")
        await wait_until(lambda: server.table.states == {})
        a[1].close()
        await wait_until(lambda: server.table.states == {} and not server.connections)
    finally:
        await server.close()


async def test_wrong_auth_and_vocab_mismatch_are_refused(models, tiny_dir):
    target, draft = models
    server = DraftServer(draft, ModelChainDrafter(draft.decoder, 3), DraftServerConfig(port=0, auth_token="s3cret"))
    port = await server.start()
    try:
        with pytest.raises(AuthError, match="authentication failed"):
            await _raw_target_connection(port, target.vocab_fingerprint, auth="wrong")
        with pytest.raises(AuthError):
            await _raw_target_connection(port, target.vocab_fingerprint)
        other = load_model("other", tiny_dir["llama-other-vocab"], "fp32")
        client = DraftClient("127.0.0.1", port, model="other", fingerprint=other.vocab_fingerprint, auth_token="s3cret")
        first = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(client.run(first))
        with pytest.raises(VocabMismatch, match="vocabulary mismatch"):
            await first
        await task
        reader, writer = await _raw_target_connection(port, target.vocab_fingerprint, auth="s3cret")
        writer.close()
    finally:
        await server.close()


async def test_tls_between_target_and_draft(models, tmp_path):
    from specctl.runtime.tls import client_context, server_context

    cert, key = self_signed_cert(tmp_path)
    draft_server, _, client, link, target_server, port = await start_star(
        models, draft_ssl=server_context(cert, key), client_ssl=client_context(cert))
    try:
        tokens, _, stats = await remote_generate("127.0.0.1", port, PROMPTS[1], SamplingParams(max_tokens=16, ignore_eos=True))
        assert tokens == local_reference(models, PROMPTS[1], 16)
        assert target_server.totals.ar_rounds == 0 and stats["rounds"] > 0
        # A plain-TCP client cannot talk to the TLS server.
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError, OSError)):
            await _raw_target_connection(client.port, models[0].vocab_fingerprint)
    finally:
        await stop_star(draft_server, link, target_server)


async def test_bad_generate_requests_get_errors_and_the_server_carries_on(models):
    draft_server, _, _, link, target_server, port = await start_star(models)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await client_handshake(reader, writer, role="client")
        await write_message(writer, Generate(1, [1, 2], 8, temperature=-1.0))
        error = await read_message(reader)
        assert error.code == "bad_request" and error.message == "temperature must be between 0 and 100, got -1.0"
        await write_message(writer, Generate(2, [1] * 600, 8))
        assert "exceeds the context of 512 tokens" in (await read_message(reader)).message
        writer.write(encode(Propose(1, [], [])))
        assert (await read_message(reader)).code == "unexpected"
        writer.close()
        tokens, _, _ = await remote_generate("127.0.0.1", port, PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
        assert tokens == local_reference(models, PROMPTS[0], 8)
    finally:
        await stop_star(draft_server, link, target_server)


async def test_starsd_admission_refuses_a_target_beyond_n_max_which_then_runs_autoregressively(models):
    from specctl.draft.plan import StarModel

    target, draft = models
    plan = StarModel(0.1, 0.22, 0.001, 0.8, 3)  # S = 300 ms > Z: a second target already slows both
    standalone = (plan.per_target_throughput(1) + plan.per_target_throughput(2)) / 2  # N_max = 1
    assert plan.n_max(standalone) == 1
    draft_server = DraftServer(draft, ModelChainDrafter(draft.decoder, 3),
                               DraftServerConfig(port=0, admission_model=plan, standalone_tokens_per_s=standalone))
    draft_port = await draft_server.start()
    servers, links = [], []
    try:
        for _ in range(2):
            client = DraftClient("127.0.0.1", draft_port, model=target.name, fingerprint=target.vocab_fingerprint)
            first = asyncio.get_running_loop().create_future()
            links.append(asyncio.create_task(client.run(first)))
            assert await first
            servers.append(TargetServer(target, TargetServerConfig(port=0), client))
        ports = [await server.start() for server in servers]
        params = SamplingParams(max_tokens=300, ignore_eos=True)
        started = asyncio.Event()
        admitted = asyncio.create_task(remote_generate("127.0.0.1", ports[0], PROMPTS[0], params, lambda t: started.set()))
        await started.wait()
        short = SamplingParams(max_tokens=30, ignore_eos=True)
        tokens, _, stats = await remote_generate("127.0.0.1", ports[1], PROMPTS[1], short)
        assert tokens == local_reference(models, PROMPTS[1], 30)  # refused: slower, never different
        assert stats["drafted"] == 0 and servers[1].totals.ar_rounds == 29
        assert stats["fallback_rounds"] == 29  # the draft refused it: a fallback, counted as one
        assert (await admitted)[0] == local_reference(models, PROMPTS[0], 300)
        assert servers[0].totals.rounds > 0
    finally:
        for link in links:
            link.cancel()
        for server in servers:
            await server.close()
        await draft_server.close()


async def test_a_session_refused_by_a_full_draft_server_drafts_once_it_has_room(models, monkeypatch, caplog):
    """The draft server's one session is taken: the second session runs autoregressively, asks
    again every REOPEN_AFTER_S, and drafts once the first has ended (it ran AR to its end);
    both outputs exactly the target's, and no warning per refusal."""
    from specctl.verify import draft_client as draft_client_module

    monkeypatch.setattr(draft_client_module, "REOPEN_AFTER_S", 0.1)
    draft_server, _, _, link, server, port = await start_star(models, max_sessions=1, verify_delay_s=0.01)
    try:
        started = asyncio.Event()
        holder = asyncio.create_task(remote_generate("127.0.0.1", port, PROMPTS[0], SamplingParams(
            max_tokens=12, ignore_eos=True), lambda t: started.set()))
        await started.wait()
        tokens, _, stats = await remote_generate("127.0.0.1", port, PROMPTS[1],
                                                 SamplingParams(max_tokens=150, ignore_eos=True))
        assert tokens == local_reference(models, PROMPTS[1], 150)
        assert stats["fallback_rounds"] > 0 and stats["drafts"] > 0  # refused first, drafting later
        assert (await holder)[0] == local_reference(models, PROMPTS[0], 12)
        assert not [r for r in caplog.records if r.levelname == "WARNING" and "capacity" in r.getMessage()]
    finally:
        await stop_star(draft_server, link, server)


async def test_a_full_draft_server_closes_a_silent_targets_connection_and_its_sessions_go_to_the_others(
        models, monkeypatch, caplog):
    """A stopped target process keeps its connection and sessions: once the server is full, a
    target that has sent nothing for STALE_TARGET_S is disconnected, and the asking target's
    session (refused, asked again) drafts; a live target's heartbeat keeps it from that."""
    from specctl.draft import opening
    from specctl.verify import draft_client as draft_client_module

    monkeypatch.setattr(opening, "STALE_TARGET_S", 0.6)
    monkeypatch.setattr(draft_client_module, "HEARTBEAT_S", 0.1)
    monkeypatch.setattr(draft_client_module, "REOPEN_AFTER_S", 0.1)
    target = models[0]
    draft_server, draft_port, _, link, server, port = await start_star(models, max_sessions=1, verify_delay_s=0.01)
    reader, writer = await asyncio.open_connection("127.0.0.1", draft_port)  # a target that then stops
    try:
        await client_handshake(reader, writer, role="target", model=target.name, fingerprint=target.vocab_fingerprint)
        await write_message(writer, OpenSession(1, [1, 2, 3], max_tokens=16))
        assert isinstance(await asyncio.wait_for(read_message(reader), 10), SessionOpened)
        await asyncio.sleep(1.0)  # the live target's heartbeats: it is never the silent one
        live = [c for c in draft_server.connections.values() if not c.tags]
        assert len(live) == 1 and time.monotonic() - live[0].heard_at < 0.5
        tokens, _, stats = await remote_generate("127.0.0.1", port, PROMPTS[1],
                                                 SamplingParams(max_tokens=150, ignore_eos=True))
        assert tokens == local_reference(models, PROMPTS[1], 150)
        assert stats["fallback_rounds"] > 0 and stats["drafts"] > 0  # refused first, drafting once the room was freed
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await asyncio.wait_for(read_message(reader), 5)  # the silent target's connection was closed
        said = [r.getMessage() for r in caplog.records if r.name == "specctl.draft" and r.levelname == "WARNING"]
        assert len(said) == 1 and re.fullmatch(
            r"target \S+ holds 1 session but has sent nothing for \d+ s while the server is full: closing its "
            r"connection \(a stopped or hung process; it reconnects if it resumes\)", said[0]), said
    finally:
        writer.close()
        await stop_star(draft_server, link, server)


async def test_a_draft_server_that_closes_the_link_is_said_to_have_closed_it(models, caplog):
    target, draft = models
    draft_server = DraftServer(draft, ModelChainDrafter(draft.decoder, 3), DraftServerConfig(port=0))
    client = DraftClient("127.0.0.1", await draft_server.start(), model=target.name,
                         fingerprint=target.vocab_fingerprint)
    first = asyncio.get_running_loop().create_future()
    link = asyncio.create_task(client.run(first))
    try:
        assert await first
        await draft_server.close()
        await wait_until(lambda: not client.connected.is_set(), what="the loss")
        assert (f"lost the draft server at 127.0.0.1:{client.port} (it closed the connection); decoding "
                "autoregressively and reconnecting") in caplog.text  # it said "IncompleteReadError"
    finally:
        link.cancel()


async def test_an_unreachable_draft_server_is_said_in_plain_words(models):
    from specctl.bench.processes import free_port

    target, _ = models
    client = DraftClient("127.0.0.1", free_port(), model=target.name, fingerprint=target.vocab_fingerprint)
    first = asyncio.get_running_loop().create_future()
    link = asyncio.create_task(client.run(first))
    try:
        assert await first is False and client.last_error == "connection refused"  # was "ConnectionRefusedError: [Errno 111] ..."
    finally:
        link.cancel()


async def test_a_flooding_peer_is_slowed_down_not_dropped(models):
    """The per-peer rate limit: 60 stats requests at once against a limit of 20/s all get
    their answer; the server counts the ones that had to wait."""
    target, draft = models
    server = DraftServer(draft, ModelChainDrafter(draft.decoder, 3), DraftServerConfig(port=0, max_messages_per_s=20))
    port = await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await client_handshake(reader, writer, role="monitor")
        for _ in range(60):
            writer.write(encode(StatsRequest()))
        replies = [await asyncio.wait_for(read_message(reader), 30) for _ in range(60)]
        assert all(isinstance(r, Stats) for r in replies)
        assert server.snapshot()["throttled"] >= 30
        writer.close()
    finally:
        await server.close()


async def test_the_draft_server_follows_the_requests_rules_and_grammar(models):
    """OpenSession carries the logit rules, min_p and the grammar; the draft's guide counts the
    output the target committed before the session opened as output."""
    import json

    from specctl.spec.logit_rules import LogitRules

    target, draft = models
    server = DraftServer(draft, ModelChainDrafter(draft.decoder, 3), DraftServerConfig(port=0))
    table = server.table
    ab = draft.tokenizer.encode("ab")
    table.open(1, OpenSession(1, [5, 9, 13, *ab], 0.7, 1.0, 0, 3, 20, 0.05, structured_kind="regex",
                              structured_spec="[a-c]+", generated=2, presence_penalty=0.5, frequency_penalty=0.25,
                              repetition_penalty=1.3, min_tokens=4, logit_bias={7: -5.0}))
    state = table.states[1]
    guide = state.session.guide
    assert isinstance(guide, LogitRules) and state.params.min_p == 0.05
    assert guide.counts[ab].tolist() == [1.0, 1.0] and guide.counts.sum() == 2 and guide.produced == 2
    assert guide.in_prompt[[5, 9, 13]].all() and not guide.in_prompt[ab].any()
    assert (guide.presence, guide.frequency, guide.repetition, guide.min_tokens) == (0.5, 0.25, 1.3, 4)
    assert float(guide.bias[7]) == -5.0
    assert not guide.structure.lost and guide.structure.matcher.validate_tokens(ab) == 2  # "ab" read: more may come
    rows, _ = guide.structure.allowed([[]])
    assert rows[0, draft.tokenizer.encode("c")].all() and not rows[0, draft.tokenizer.encode("d")].any()
    table.open(2, OpenSession(2, [5, 9, 13, *draft.tokenizer.encode("x")], structured_kind="regex",
                              structured_spec="[a-c]+", generated=1))  # output the grammar refuses: drafting free
    assert table.states[2].session.guide.structure.lost
    table.open(3, OpenSession(3, [5, 9, 13], structured_kind="choice", structured_spec=json.dumps(["ab"])))
    assert table.states[3].session.guide.structure is not None
    table.open(4, OpenSession(4, [5, 9, 13]))  # nothing to follow
    assert table.states[4].session.guide is None
    table.open(5, OpenSession(5, [5, 9, 13], logit_bias={10**6: 1.0}))  # the target refuses it: the draft drafts free
    assert table.states[5].session.guide is None
    # a thinking budget: the prompt opened a thought (<think> = 9 here) and 2 of its tokens are output already
    table.open(6, OpenSession(6, [5, 9, 13, 14], generated=2, thinking_budget=2, thinking_start=[9], thinking_end=[10]))
    thinking = table.states[6].session.guide
    assert thinking.thought.thinking and thinking.thought.used == 2 and thinking.thinking.forced(thinking.thought) == 10
    for tag in range(1, 7):
        table.close(tag)


async def test_a_draft_error_nobody_waits_for_is_no_warning_and_one_awaited_is(caplog):
    """A session closed while its request to the draft server was out gets the answer
    "unknown tag" after it left: nothing to warn about. An awaited request's error is handed to
    its waiter and logged as a warning."""
    client = DraftClient("127.0.0.1", 1, model="m", fingerprint="f")
    waiting = asyncio.get_running_loop().create_future()
    client._pending[("tag", 6)] = waiting
    client._reader = asyncio.StreamReader()
    client._reader.feed_data(encode(Error("unknown_tag", "unknown session tag 5", tag=5))
                             + encode(Error("unknown_tag", "unknown session tag 6", tag=6)))
    client._reader.feed_eof()
    with caplog.at_level(logging.DEBUG, logger="specctl.verify"), pytest.raises(asyncio.IncompleteReadError):
        await client._read_loop()
    assert waiting.result() == Error("unknown_tag", "unknown session tag 6", tag=6)
    levels = {r.getMessage(): r.levelno for r in caplog.records if r.getMessage().startswith("draft server error")}
    assert levels == {"draft server error unknown_tag: unknown session tag 5": logging.DEBUG,
                      "draft server error unknown_tag: unknown session tag 6": logging.WARNING}
