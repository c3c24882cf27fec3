"""``specctl bench prespec``: the comparison and spread (pure) and one small real run of
both star clusters as processes."""

import pytest

from specctl.bench.prespec import PrespecBenchSettings, compare, first_loads, loads_past_two, run_prespec_bench, summarize
from specctl.bench.star import StarBenchSettings


def test_compare_predicts_ssds_round_on_the_star_against_plains_measured_round():
    plain = {"N": 1, "O": 10.0, "mean_accepted_length": 3.0, "R_p": 5.0}  # a round of 0.2 s = S + Z
    pre = {"N": 1, "O": 15.0, "mean_accepted_length": 3.0, "hit_rate": 1.0, "ready_rate": 1.0, "ready_share": 1.0}
    # every outcome hit, S = Z: the draft time (T_p = 1) is hidden entirely -> 2x
    pair = compare(plain, pre, service_s=0.1, return_s=0.1)
    assert pair["predicted_gain"] == pytest.approx(2.0) and pair["gain"] == pytest.approx(1.5)
    assert pair["prediction_error"] == pytest.approx(-0.25) and pair["T_p"] == pytest.approx(1.0)
    # half the rounds ready: (1 + 1) / (0.5 + 0.5 * 2) = 4/3
    assert compare(plain, {**pre, "ready_share": 0.5}, 0.1, 0.1)["predicted_gain"] == pytest.approx(4 / 3)
    # every outcome hit, but each branch only half drafted when it came: the model sees half of them ready
    half = compare(plain, {**pre, "ready_rate": 0.5, "ready_share": 0.5}, 0.1, 0.1)
    assert half["predicted_gain"] == pytest.approx(4 / 3) and half["hit_rate"] == 1.0 and half["ready_rate"] == 0.5
    # N = 3, plain's rounds queued to 0.4 s (measured), half the rounds ready: SSD's round 0.15 s, 3 misses
    # of 0.1 s at 50 % keep the draft 0.15 s, plus half a background step of 0.04 s: 0.4 / 0.17
    three = compare({**plain, "N": 3, "R_p": 2.5}, {**pre, "N": 3, "ready_share": 0.5}, 0.1, 0.1, step_s=0.04)
    assert three["predicted_gain"] == pytest.approx(0.4 / 0.17)
    # the pre-speculating server's own mean background step, when the row has it, rather than plain's step
    measured = compare({**plain, "N": 3, "R_p": 2.5}, {**pre, "N": 3, "ready_share": 0.5, "background_step_mean_ms": 100.0},
                       0.1, 0.1, step_s=0.04)
    assert measured["predicted_gain"] == pytest.approx(0.4 / 0.2)
    # nothing ready at N = 3: every round a miss, the draft bound by them (3 x 0.1 s) against plain's queued 0.4 s
    assert compare({**plain, "N": 3, "R_p": 2.5}, {**pre, "N": 3, "ready_share": 0.0}, 0.1, 0.1)["predicted_gain"] == \
        pytest.approx(0.4 / 0.3)
    # a row of an older report without the ready share: the ready rate
    assert compare(plain, {k: v for k, v in pre.items() if k != "ready_share"}, 0.1, 0.1)["ready_share"] == 1.0
    # 9 of 10 rounds answered at once by the event loop (early answers): theirs is the target's own side of
    # plain's round, 0.07 s of Z's 0.1, the last round a miss: 0.2 / (0.9 * 0.07 + 0.1 * 0.2)
    early = {**pre, "ready_share": 0.9, "early_share": 0.9}
    assert compare(plain, early, 0.1, 0.1, own_return_s=0.07)["predicted_gain"] == pytest.approx(0.2 / 0.083)
    assert compare(plain, early, 0.1, 0.1)["predicted_gain"] == pytest.approx(0.2 / 0.11)  # without it: SSD's


def test_summary_reports_min_median_max_per_n():
    pairs = [{"N": 1, "gain": g, "predicted_gain": 1.5, "prediction_error": g / 1.5 - 1, "hit_rate": 0.8,
              "same_as_plain": True} for g in (1.2, 1.5, 1.4)]
    summary = summarize(pairs + [{**pairs[0], "N": 2, "same_as_plain": False}])
    assert summary["1"]["gain"] == {"min": 1.2, "median": 1.4, "max": 1.5}
    assert summary["1"]["same_as_plain"] is True and summary["2"]["same_as_plain"] is False


def test_the_delay_and_the_floor_are_alternatives():
    from specctl.cli.bench_prespec import emulated_delay_ms

    assert emulated_delay_ms(None, 0.0) == 60.0  # the default emulation: a delay
    assert emulated_delay_ms(None, 150.0) == 0.0  # --verify-time-ms alone: 150 ms, not 60 ms more
    assert emulated_delay_ms(25.0, 150.0) == 25.0  # both given: both, as asked


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_prespec_bench_runs_both_clusters_of_real_processes(tiny_dir, mode):
    tiny = str(tiny_dir["llama"])
    star = StarBenchSettings(f"{tiny}@2", tiny, (1, 2, 3), depth=3, max_tokens=16, verify_delay_ms=20.0, dtype="fp32",
                             mode=mode, max_batches=(8,), draft_quant="none", sessions=1,
                             draft_step_ms=5.0 if mode == "tree" else 0.0)
    calls = []
    # Without trials: every round is pre-speculated (a trial could fall in a phase without it).
    report = run_prespec_bench(PrespecBenchSettings(star, budget=4, repeats=1, trials=False), [[5, 9, 13, 2], [7, 8, 9]],
                               lambda added=0: calls.append(added))
    rows = report["rows"]
    assert [r["mode"] for r in rows[:4]] == ["plain", "prespec", "plain", "prespec"]
    assert [r["N"] for r in rows[:4]] == [1, 1, 2, 2]
    pre = [r for r in rows if r["mode"] == "prespec"]
    assert all(r["hits"] + r["misses"] > 0 and r["skipped"] == 0 for r in pre)
    assert sum(r["branches_drafted"] for r in pre) > 0
    assert all(p["same_as_plain"] for p in report["pairs"])  # exact: the same texts as plain speculation
    assert set(report["summary"]) >= {"1", "2"}
    assert report["settings"]["mode"] == mode
    if mode == "tree":  # the emulated draft device: every background forward took the floor at least
        assert report["settings"]["draft_step_ms"] == 5.0
        assert all(r["background_step_max_ms"] >= 5.0 for r in pre if r["branches_drafted"])


@pytest.mark.parametrize(("n_full", "max_targets", "loads"), [
    (3, 4, [3, 4]),  # N_full and one past it
    (3, 3, [3]),  # no process for N_full + 1
    (6, 4, [4]),  # as near N_full as the processes allow, nothing past it
    (2, 4, [3]),  # N = 2 is measured anyway: N_full + 1 only
    (1, 4, []),  # a draft never idle even at N = 1: 1 and 2 cover it
])
def test_the_loads_past_two_are_n_full_and_one_past_it_as_far_as_the_processes_allow(n_full, max_targets, loads):
    assert loads_past_two(n_full, max_targets) == loads


def test_n_1_and_2_come_first_as_far_as_the_processes_allow():
    assert first_loads(1) == [1] and first_loads(2) == [1, 2] and first_loads(4) == [1, 2]
