"""``specctl bench star``: the model fit and the scaling summary (pure), and one small real
run — draft server and targets as processes, identical sessions per target, two batching sweeps."""

import statistics

import pytest

from specctl.bench.render import render_star_summary, render_star_table
from specctl.bench.star import StarBenchSettings, predict, run_star_bench, summarize, summarize_repeats


def row(n: int, max_batch: int = 1, **values) -> dict:
    return {"N": n, "max_batch": max_batch, "t_s_ms": 125.0, "t_v_ms": 250.0, "R_p": 2.0,
            "mean_accepted_length": 2.0, **values}


def test_predict_fits_the_model_to_n1_and_uses_each_rows_acceptance():
    # S = 125 ms, t_v = 250 ms, round at N=1 = 1/R_p = 500 ms -> t_c = 125 ms, Z = 375 ms = 3 S.
    rows = [row(1), row(2), row(6, mean_accepted_length=1.5)]
    predict(rows, depth=4)
    assert [r["N_full"] for r in rows] == [4, 4, 4]  # ceil(Z / S) + 1
    assert rows[0]["model_t_c_ms"] == pytest.approx(125.0)
    assert rows[0]["model_O"] == pytest.approx(1 * 2.0 / 0.5)  # round = S + Z
    assert rows[1]["model_O"] == pytest.approx(2 * 2.0 / 0.5)  # idle 250 ms: round = 2 S + 250 ms
    assert rows[1]["model_load"] == pytest.approx(0.5)
    assert rows[2]["model_O"] == pytest.approx(6 * 1.5 / 0.75)  # fully loaded: round = 6 S
    assert rows[2]["model_load"] == 1.0 and rows[2]["model_T_idle_ms"] == 0.0
    assert [r["regime"] for r in rows] == ["under-loaded", "under-loaded", "fully loaded"]


def test_summarize_reads_the_scaling_figures():
    serial = [dict(N=n, max_batch=1, N_full=4, O=o, R_q=o / 2, model_O=m, load=load, model_S_ms=100.0, t_v_ms=250.0, model_t_c_ms=50.0)
              for n, o, m, load in ((1, 5.0, 5.0, 0.25), (4, 18.0, 20.0, 0.97), (6, 20.0, 20.0, 1.0), (8, 19.0, 20.0, 0.99))]
    batched = [dict(N=n, max_batch=4, N_full=4, O=o, R_q=o / 3, model_O=m, load=load, model_S_ms=100.0, t_v_ms=250.0, model_t_c_ms=50.0)
               for n, o, m, load in ((1, 5.0, 5.0, 0.25), (4, 19.0, 20.0, 0.9), (8, 33.0, 20.0, 0.95))]
    summary = summarize(serial + batched)
    assert summary == {"N_full": 4, "Z_over_S": 3.0, "max_model_error_past_fit": pytest.approx(0.1),
                       "model_error_by_N": [[1, 0.0], [4, pytest.approx(-0.1)], [6, 0.0], [8, pytest.approx(-0.05)]],
                       "min_load_n_ge_n_full": 0.97,
                       "reference_N": 4, "reference_O": 18.0, "batched_N": 8, "batched_max_batch": 4,
                       "batched_O": 33.0, "batched_gain": pytest.approx(33.0 / 18.0),
                       "batched_round_gain": pytest.approx((33.0 / 3) / (18.0 / 2))}


def test_summarize_without_a_measured_n_past_n_full():
    rows = [dict(N=1, max_batch=1, N_full=5, O=5.0, model_O=4.0, load=0.2, model_S_ms=80.0, t_v_ms=300.0, model_t_c_ms=20.0)]
    assert summarize(rows) == {"N_full": 5, "Z_over_S": 4.0, "model_error_by_N": [[1, pytest.approx(0.25)]],
                               "max_model_error_past_fit": None}


def _summary(gain: float, reference_o: float, error: float) -> dict:
    return {"N_full": 3, "Z_over_S": 2.0, "model_error_by_N": [[1, 0.0], [4, error]], "max_model_error_past_fit": error,
            "min_load_n_ge_n_full": 0.9, "reference_N": 3, "reference_O": reference_o, "batched_N": 4,
            "batched_max_batch": 4, "batched_O": gain * reference_o, "batched_gain": gain, "batched_round_gain": gain + 0.1}


def test_repeats_are_summarized_by_the_repeat_of_the_median_gain_with_each_figures_spread():
    summaries = [_summary(1.5, 10.0, 0.02), _summary(1.7, 8.0, -0.05), _summary(1.6, 9.0, 0.04)]
    summary = summarize_repeats(summaries)
    assert {k: v for k, v in summary.items() if k not in ("repeats", "spread")} == summaries[2]
    assert summary["repeats"] == 3
    assert summary["spread"] == {
        "batched_gain": {"min": 1.5, "median": 1.6, "max": 1.7},
        "batched_round_gain": {"min": 1.6, "median": 1.7, "max": 1.8},
        "reference_O": {"min": 8.0, "median": 9.0, "max": 10.0},
        "batched_O": {"min": 13.6, "median": 14.4, "max": 15.0},
        "max_model_error_past_fit": {"min": -0.05, "median": 0.02, "max": 0.04}}
    assert summaries[2] == _summary(1.6, 9.0, 0.04)  # the repeats' own summaries are not changed
    # an even count takes the lower median, a repeat that was measured
    assert summarize_repeats(summaries[:2])["batched_gain"] == 1.5
    assert summarize_repeats(summaries[:1]) == summaries[0]
    text = render_star_summary(summary)
    assert text.splitlines()[-1] == ("over 3 repeats (the lines above: the repeat of the median batched gain), min / "
                                     "median / max: batched_gain 1.50 / 1.60 / 1.70; batched_round_gain 1.60 / 1.70 / "
                                     "1.80; reference_O 8.00 / 9.00 / 10.00; batched_O 13.60 / 14.40 / 15.00; "
                                     "max_model_error_past_fit -0.05 / 0.02 / 0.04")


def test_repeats_where_no_n_reached_n_full_keep_the_first_and_the_figures_every_repeat_has():
    first = {"N_full": 5, "Z_over_S": 4.0, "model_error_by_N": [[1, 0.0], [2, 0.1]], "max_model_error_past_fit": 0.1}
    second = {**first, "model_error_by_N": [[1, 0.0], [2, -0.2]], "max_model_error_past_fit": 0.2}
    summary = summarize_repeats([first, second])
    assert summary == {**first, "repeats": 2,
                       "spread": {"max_model_error_past_fit": {"min": 0.1, "median": pytest.approx(0.15), "max": 0.2}}}
    assert render_star_summary(summary).splitlines()[1:] == [
        "over 2 repeats (the lines above: the first repeat), min / median / max: max_model_error_past_fit 0.10 / 0.15 / 0.20"]


@pytest.mark.slow
def test_star_bench_runs_two_sweeps_of_real_processes(tiny_dir):
    tiny = str(tiny_dir["llama"])
    settings = StarBenchSettings(f"{tiny}@2", tiny, (1, 2), depth=3, max_tokens=24, verify_delay_ms=20.0, dtype="fp32",
                                 max_batches=(1, 2), draft_quant="none", sessions=2)
    calls = []
    report = run_star_bench(settings, [[5, 9, 13, 2], [7, 8, 9]], lambda added=0: calls.append(added))
    rows = report["rows"]
    assert [(r["max_batch"], r["N"]) for r in rows if r["N"] in (1, 2)] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for r in rows:
        assert r["O"] > 0 and r["R_q"] > 0 and 0 < r["load"] <= 1.0
        assert r["mean_batch"] >= 1.0 and r["t_v_ms"] >= 20.0 and r["proposal_ms"] > 0
        assert 1.0 <= r["mean_accepted_length"] <= 4.0  # depth 3: at most 3 accepted + 1
    assert all(r["mean_batch"] == 1.0 for r in rows if r["max_batch"] == 1)
    assert report["settings"]["emulated"] is True and report["settings"]["max_batches"] == [1, 2]
    assert report["summary"]["N_full"] == rows[0]["N_full"]
    assert calls.count(0) == len(rows)


@pytest.mark.slow
def test_star_bench_repeats_each_sweep_with_the_same_processes(tiny_dir):
    """Two repeats: every (batching limit, N) measured once a repeat, each repeat fitted on
    its own N=1, the summary the median repeat's with the spread of its figures."""
    tiny = str(tiny_dir["llama"])
    settings = StarBenchSettings(f"{tiny}@2", tiny, (1, 2), depth=3, max_tokens=12, verify_delay_ms=20.0, dtype="fp32",
                                 max_batches=(1, 2), draft_quant="none", sessions=1, repeats=2)
    calls = []
    report = run_star_bench(settings, [[5, 9, 13, 2]], lambda added=0: calls.append(added))
    rows = report["rows"]
    assert [(r["max_batch"], r["repeat"], r["N"]) for r in rows] == [
        (limit, repeat, n) for limit in (1, 2) for repeat in (0, 1) for n in (1, 2)]  # N_full can only be 1 or 2 here
    for repeat in (0, 1):  # S: the median t_s of the repeat's own one-at-a-time rows
        serial = [r for r in rows if (r["max_batch"], r["repeat"]) == (1, repeat)]
        service = statistics.median(r["t_s_ms"] for r in serial)
        assert [r["model_S_ms"] for r in serial] == [pytest.approx(service, abs=1e-3)] * 2
    assert report["settings"]["repeats"] == 2 and report["summary"]["repeats"] == 2
    assert "max_model_error_past_fit" in report["summary"]["spread"]
    assert calls == [0] * len(rows)
    assert render_star_table(report).columns[0].header == "repeat"


def test_predict_takes_s_as_the_median_of_one_at_a_time_rows():
    # N=1's run was slow (t_s 150 ms); the median of the one-at-a-time rows is 125 ms, and
    # a batched row's amortized t_s (60 ms at 2 requests per forward) is not a service time.
    rows = [row(1, t_s_ms=150.0, R_p=2.0), row(2), row(3), row(4, mean_batch=2.0, t_s_ms=60.0)]
    predict(rows, depth=4)
    assert rows[0]["model_S_ms"] == pytest.approx(125.0)
    assert rows[0]["model_t_c_ms"] == pytest.approx(500.0 - 150.0 - 250.0)  # N=1's own round
    assert rows[3]["model_O"] == pytest.approx(4 * 2.0 / (4 * 0.125 + max(0.0, 0.35 - 3 * 0.125)))
