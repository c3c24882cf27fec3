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
