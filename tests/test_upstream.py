"""The gateway's picture of the roles behind it (gateway/upstream.py): which draft servers it
watches, found in its target instances' stats."""

import asyncio

import pytest

from specctl.gateway import upstream as upstream_module
from specctl.errors import ConfigError
from specctl.gateway.role_stats import draft_servers
from specctl.gateway.upstream import Upstream
from specctl.net.protocol import Welcome


def test_the_draft_servers_a_target_names_one_or_several_not_the_local_lookups():
    assert draft_servers({"draft_address": "laptop:9000"}) == ["laptop:9000"]
    assert draft_servers({"draft_address": None}) == []
    assert draft_servers({}) == []
    several = {"draft_address": None,
               "drafters": {"127.0.0.1:9000": {}, "10.0.0.2:9001": {}, "ngram": {}, "suffix": {}, "none": {}}}
    assert draft_servers(several) == ["127.0.0.1:9000", "10.0.0.2:9001"]


def test_the_gateway_watches_every_draft_server_its_targets_name_once():
    upstream = Upstream(["127.0.0.1:1", "127.0.0.1:2"], drafters=["127.0.0.1:9000"])
    upstream.targets[0].stats = {"draft_address": "127.0.0.1:9000"}
    upstream.targets[1].stats = {"draft_address": None, "drafters": {"127.0.0.1:9000": {}, "127.0.0.1:9001": {},
                                                                     "ngram": {}, "none": {}}}
    upstream._discover_drafters()
    upstream._discover_drafters()  # every poll: nothing is added twice
    assert [(d.role, d.address) for d in upstream.drafters] == [("draft", "127.0.0.1:9000"),
                                                                 ("draft", "127.0.0.1:9001")]


def test_a_pipelined_target_whose_chain_is_broken_is_down_until_it_is_whole(monkeypatch, caplog):
    """Stage 1 answers the poll while its chain to the other stages is broken: it would refuse
    every request (after a round trip each), so it is down, saying why, until the chain is whole."""
    answers = {"pipeline_connected": False, "pipeline_error": "stage 127.0.0.1:9111: connection refused"}

    async def probe(host, port, auth_token, ssl):
        return Welcome(5, "target", "m", "f", 4), dict(answers)

    monkeypatch.setattr(upstream_module, "probe", probe)
    upstream = Upstream(["127.0.0.1:1", "127.0.0.1:2"])
    link = upstream.targets[0]
    asyncio.run(upstream._poll(link))
    asyncio.run(upstream._poll(link))
    assert not link.up and link.error == "its pipeline is down (stage 127.0.0.1:9111: connection refused)"
    # said once, on the first poll (a role never up is down from the start), not at every poll
    assert [r.getMessage() for r in caplog.records] == [
        "target 127.0.0.1:1 is down: its pipeline is down (stage 127.0.0.1:9111: connection refused)"]
    answers.update(pipeline_connected=True, pipeline_error=None)
    asyncio.run(upstream._poll(link))
    assert link.up and link.error == ""
    answers.pop("pipeline_connected")  # a target of one stage says nothing of a pipeline
    asyncio.run(upstream._poll(link))
    assert link.up


def test_a_target_of_another_vocabulary_is_down_and_said_once(monkeypatch, caplog):
    """An instance started with another model would detokenize wrong: it never serves, and the
    log says so once (it used to be marked down without a word)."""
    async def probe(host, port, auth_token, ssl):
        return Welcome(5, "target", "other-model", "other-fingerprint", 4), {}

    monkeypatch.setattr(upstream_module, "probe", probe)
    upstream = Upstream(["127.0.0.1:1"], fingerprint="gateway-fingerprint")
    link = upstream.targets[0]
    asyncio.run(upstream._poll(link))
    asyncio.run(upstream._poll(link))
    why = ("it serves other-model, whose vocabulary differs from the gateway's tokenizer: every --target must serve "
           "the model the gateway was started for")
    assert not link.up and link.error == why
    assert [r.getMessage() for r in caplog.records] == [f"target 127.0.0.1:1 is down: {why}"]


def test_an_instance_named_twice_is_refused():
    with pytest.raises(ConfigError, match=r"^--target names 127\.0\.0\.1:1 twice: each instance once$"):
        Upstream(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:01"])
    with pytest.raises(ConfigError, match=r"^--drafter names d:9 twice: each instance once$"):
        Upstream(["127.0.0.1:1"], drafters=["d:9", "d:9"])


def test_an_instance_silent_past_the_stall_limit_loses_its_streams_with_why(monkeypatch):
    """A target that stops answering (a hung process or box, a link that drops without a reset)
    keeps its TCP connection: its streams would wait for ever. Once its polls have gone
    unanswered for STALLED_AFTER_S, and another instance is up, the gateway closes that
    connection, and each stream ends as lost (gateway.choices then goes on with it there),
    saying why."""
    from specctl.verify.client import RemoteError, TargetConnection, TargetStream

    async def probe(host, port, auth_token, ssl):
        raise TimeoutError

    async def main():
        monkeypatch.setattr(upstream_module, "probe", probe)
        upstream = Upstream(["127.0.0.1:1", "127.0.0.1:2"])
        link, other = upstream.targets
        link.up = True
        link.connection = TargetConnection("127.0.0.1", 1, "gateway")  # a stream on it, waiting
        queue = asyncio.Queue()
        link.connection._streams[1] = queue
        await upstream._poll(link)  # the first unanswered poll: down, the connection kept
        assert not link.up and link.connection is not None and link.silent_since is not None
        link.silent_since -= upstream_module.STALLED_AFTER_S  # as if it had been silent that long
        connection = link.connection
        await upstream._poll(link)
        assert link.connection is connection and not connection.closed  # no other instance up: its streams wait
        other.up = True
        await upstream._poll(link)
        assert link.connection is None and connection.closed
        with pytest.raises(RemoteError, match=r"^target instance 127\.0\.0\.1:1 stopped answering \(TimeoutError\) "
                                              r"for 1\d s mid-stream$") as err:
            await TargetStream(connection, 1, queue).next()
        assert err.value.code == "disconnected"

    asyncio.run(main())
