"""pipeline.pipe_stats: a SpecPipe session's counters, summed over sessions and reported."""

from dataclasses import fields

import pytest

from specctl.pipeline.pipe_stats import PipeStats


def test_adding_sums_every_counter():
    """Each field (a counter added later too) is summed, none left behind."""
    one = PipeStats(**{counter.name: index + 1 for index, counter in enumerate(fields(PipeStats))})
    total = PipeStats()
    total.add(one)
    total.add(one)
    assert [getattr(total, c.name) for c in fields(PipeStats)] == [2 * (i + 1) for i in range(len(fields(PipeStats)))]


def test_the_report_has_every_counter_the_hit_rate_and_stage_1s_time_per_level():
    stats = PipeStats(steps=8, hits=6, flushes=2, levels_sent=4, stage1_s=1.2345, predicted=63, predicted_accepted=60,
                       predicted_rejected=3)
    report = stats.to_dict()
    assert report == {"steps": 8, "hits": 6, "flushes": 2, "levels_sent": 4, "stale_outputs": 0, "bubbles": 0,
                      "draft_lost": 0, "draft_reopened": 0, "levels_dropped": 0, "rows_dropped": 0, "refills": 0, "refill_tokens": 0,
                      "predicted": 63, "predicted_accepted": 60, "predicted_rejected": 3, "hit_rate": 0.75,
                      "stage1_step_ms": 308.625}
    assert stats.hit_rate == pytest.approx(0.75)


def test_a_session_that_sent_nothing_reports_zeros_not_a_division_error():
    report = PipeStats().to_dict()
    assert (report["hit_rate"], report["stage1_step_ms"]) == (0.0, 0.0)
    assert set(report) == {c.name for c in fields(PipeStats)} - {"stage1_s"} | {"hit_rate", "stage1_step_ms"}
