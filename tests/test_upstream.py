"""The gateway's picture of the roles behind it (gateway/upstream.py): which draft servers it
watches, found in its target instances' stats."""

from specctl.gateway.upstream import Upstream, draft_servers


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
