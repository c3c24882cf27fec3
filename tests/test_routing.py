"""Least-loaded routing as a pure function of target views."""

from specctl.gateway.routing import TargetView, pick_target


def test_fewest_inflight_wins_then_reported_sessions_then_index():
    views = [TargetView(True, 2, 8, 0), TargetView(True, 1, 8, 5), TargetView(True, 1, 8, 3)]
    assert pick_target(views) == 2
    assert pick_target([TargetView(True, 0, 8, 0), TargetView(True, 0, 8, 0)]) == 0


def test_down_full_and_excluded_instances_are_skipped():
    views = [TargetView(False, 0, 8), TargetView(True, 8, 8), TargetView(True, 3, 8)]
    assert pick_target(views) == 2
    assert pick_target(views, exclude=frozenset({2})) is None
    assert pick_target([]) is None
    assert pick_target([TargetView(True, 0, 0)]) is None  # capacity unknown until the first handshake


def test_the_instance_holding_the_prompts_start_wins_within_the_balance():
    # instance 1 finished a text this prompt starts with (40 tokens shared): it wins over a less loaded one
    views = [TargetView(True, 0, 8, 0), TargetView(True, 1, 8, 0, prefix_match=40)]
    assert pick_target(views) == 1
    # ... not beyond one request more in flight than the least loaded
    assert pick_target([TargetView(True, 0, 8), TargetView(True, 2, 8, 0, prefix_match=40)]) == 0
    # a start shorter than the cache's floor is no reason
    assert pick_target([TargetView(True, 0, 8), TargetView(True, 0, 8, 0, prefix_match=15)]) == 0
    # the longest shared start, then the least loaded of those
    views = [TargetView(True, 1, 8, 0, prefix_match=30), TargetView(True, 1, 8, 0, prefix_match=50),
             TargetView(True, 0, 8, 0, prefix_match=50)]
    assert pick_target(views) == 2
    # full, down or excluded: never, however much it holds
    assert pick_target([TargetView(True, 8, 8, 0, prefix_match=99), TargetView(True, 0, 8)]) == 1
    assert pick_target([TargetView(False, 0, 8, 0, prefix_match=99), TargetView(True, 1, 8)]) == 1
    assert pick_target([TargetView(True, 0, 8, 0, prefix_match=99), TargetView(True, 1, 8)], frozenset({0})) == 1



def test_an_instance_s_prefix_match_counts_only_prompts_of_the_request_s_cache_salt():
    """vLLM's cache_salt: an instance reuses a prefix only within its salt (engine.prefix_cache),
    so the gateway's picture of what it holds is salted too — a salted request is drawn only to
    the instance that prefilled its start under the same salt."""
    import numpy as np

    from specctl.gateway.upstream import Upstream
    from specctl.net.protocol import Welcome

    upstream = Upstream(["127.0.0.1:1", "127.0.0.1:2"])
    for link in upstream.targets:
        link.up, link.welcome = True, Welcome(1, "target", "m", "f", max_sessions=4)
    prompt = np.arange(40, dtype=np.int64)
    upstream.targets[1].prefilled.extend([("alice", prompt[:30]), ("", prompt[:20])])
    assert [v.prefix_match for v in upstream.views(prompt, "alice")] == [0, 30]
    assert [v.prefix_match for v in upstream.views(prompt)] == [0, 20]
    assert [v.prefix_match for v in upstream.views(prompt, "bob")] == [0, 0]
    assert [v.prefix_match for v in upstream.views(None, "alice")] == [0, 0]
    upstream.targets[1].inflight = 1  # within the balance: the holder wins for its own salt only
    assert pick_target(upstream.views(prompt, "alice")) == 1
    assert pick_target(upstream.views(prompt, "bob")) == 0
