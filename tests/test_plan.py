"""StarSD's analytical model against hand calculations."""

import json

import pytest

from specctl.draft.connection import DraftServerConfig
from specctl.draft.plan import StarModel, admit, open_refusal, prespec_round_time
from tests.conftest import run_here

# t_s = 10 ms/token, d = 4 -> S = 40 ms; Z = t_c + t_v = 20 + 100 = 120 ms; β = 0.5
MODEL = StarModel(t_s=0.010, t_v=0.100, t_c=0.020, beta=0.5, depth=4)


def test_expected_accepted_tokens():
    # 0.5 (1 - 0.5^4) / (1 - 0.5) = 0.9375
    assert MODEL.expected_accepted == pytest.approx(0.9375)


def test_idle_round_time_and_regimes():
    assert MODEL.service == pytest.approx(0.040) and MODEL.return_time == pytest.approx(0.120)
    # N=1: idle 120 ms, T = 160 ms; N=3: idle 120 - 80 = 40, T = 160; N=4: idle 0, T = 160; N=5: T = 200
    assert [round(MODEL.idle(n), 6) for n in (1, 2, 3, 4, 5)] == [0.12, 0.08, 0.04, 0.0, 0.0]
    assert [round(MODEL.round_time(n), 6) for n in (1, 4, 5)] == [0.16, 0.16, 0.2]
    assert MODEL.n_full == 4  # ceil(120 / 40) + 1
    assert MODEL.regime(3) == "under-loaded" and MODEL.regime(4) == "fully loaded"
    assert MODEL.load(1) == pytest.approx(0.25) and MODEL.load(4) == pytest.approx(1.0)


def test_throughputs():
    assert MODEL.system_throughput(4) == pytest.approx(4 * 0.9375 / 0.16)
    assert MODEL.per_target_throughput(5) == pytest.approx(0.9375 / 0.2)


def test_n_max_and_admission():
    # Per-target throughput: N<=4: 5.859 tok/s; N=5: 4.6875; N=6: 3.906
    assert MODEL.n_max(4.5) == 5 and MODEL.n_max(6.0) == 0 and MODEL.n_max(None) == 4
    assert admit(4, MODEL, 4.5) and not admit(5, MODEL, 4.5)
    assert admit(100, None, None)


def test_open_refusal_checks_limits_then_admission():
    config = DraftServerConfig(max_sessions=3, max_sessions_per_connection=2, admission_model=MODEL,
                               standalone_tokens_per_s=4.5)
    assert open_refusal(config, 0, 0, 4) is None  # the 5th target: N_max is 5
    assert open_refusal(config, 0, 0, 5) == ("admission", "draft server at N_max: another target would run slower "
                                                          "than standalone")
    assert open_refusal(config, 2, 1, 5) is None  # a target already in keeps opening sessions
    assert open_refusal(config, 2, 2, 0) == ("capacity", "at most 2 sessions per connection")
    assert open_refusal(config, 3, 0, 0) == ("capacity", "draft server full: 3 sessions open; retry later")
    assert open_refusal(DraftServerConfig(), 0, 0, 1000) is None  # no admission model: no N_max


def test_invalid_model_is_refused():
    with pytest.raises(ValueError, match="beta must be in \\[0, 1\\)"):
        StarModel(0.01, 0.1, 0.0, 1.0, 4)


def test_prespec_round_is_ssds_below_the_misses_bound_and_the_misses_above_it():
    # S = 0.1, Z = 0.1, 90 % ready: a ready hit answers at once, a miss drafts S then waits Z
    assert prespec_round_time(1, 0.9, 0.1, 0.1) == pytest.approx(0.9 * 0.1 + 0.1 * 0.2)
    # drafting longer than the verification (S = 0.2 > Z): a hit still waits for the drafting
    assert prespec_round_time(1, 1.0, 0.2, 0.1) == pytest.approx(0.2)
    # 30 targets' misses alone, 30 x 0.1 x 0.1 = 0.3 s, outlast SSD's round (0.11 s)
    assert prespec_round_time(30, 0.9, 0.1, 0.1) == pytest.approx(0.3)
    assert prespec_round_time(1, 0.0, 0.1, 0.1) == pytest.approx(0.2)  # nothing ready: plain's round
    # with other targets, a request waits out half a draft step (0.04 s) on average; alone it does not
    assert prespec_round_time(2, 0.9, 0.1, 0.1, step=0.04) == pytest.approx(0.11 + 0.02)
    assert prespec_round_time(1, 0.9, 0.1, 0.1, step=0.04) == pytest.approx(0.11)


def test_a_hit_answered_at_once_takes_the_targets_own_round_not_ssds():
    # S = 0.2 > Z = 0.1 (Z measured on plain holds 0.03 s of draft-side time): 90 % ready, 60 % of rounds
    # answered at once from a published branch (0.07 s each), 30 % waiting for their drafting (max(Z, S))
    assert prespec_round_time(1, 0.9, 0.2, 0.1, at_once=0.6, own_return=0.07) == pytest.approx(
        0.6 * 0.07 + 0.3 * 0.2 + 0.1 * 0.3)
    assert prespec_round_time(1, 0.9, 0.2, 0.1, at_once=0.6) == pytest.approx(0.6 * 0.1 + 0.3 * 0.2 + 0.1 * 0.3)
    # an own return above Z is taken as Z (the target's side of the round is part of it)
    assert prespec_round_time(1, 0.9, 0.2, 0.1, at_once=0.9, own_return=0.5) == pytest.approx(0.9 * 0.1 + 0.1 * 0.3)
    with pytest.raises(ValueError, match="at_once in \\[0, ready\\]"):
        prespec_round_time(1, 0.5, 0.1, 0.1, at_once=0.6)


def test_prespec_round_at_one_target_is_ssds_theorem_7():
    from specctl.draft.fanout import predicted_gain_over_plain

    for ready, s, z in ((0.9, 0.1, 0.1), (0.5, 0.08, 0.1), (0.92, 0.877, 0.839)):
        gain = (s + z) / prespec_round_time(1, ready, s, z, step=0.05)  # alone: no wait for another's step
        assert gain == pytest.approx(predicted_gain_over_plain(ready, 1.0, s / z))


@pytest.mark.parametrize("args", [(0, 0.5, 0.1, 0.1), (1, 1.5, 0.1, 0.1), (1, 0.5, 0.0, 0.1), (1, 0.5, 0.1, -1.0),
                                  (2, 0.5, 0.1, 0.1, -0.01)])
def test_prespec_round_refuses_impossible_inputs(args):
    with pytest.raises(ValueError, match="need n >= 1, ready in"):
        prespec_round_time(*args)


def test_plan_command_json():
    proc = run_here("plan", "--ts", "10", "--tv", "100", "--tc", "20", "--beta", "0.5", "--depth", "4", "--standalone",
                    "4.5", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["N_full"] == 4 and report["N_max"] == 5
    assert [r["regime"] for r in report["rows"]][:5] == ["under-loaded"] * 3 + ["fully loaded"] * 2
    assert report["rows"][0]["T_idle_ms"] == 120.0


def test_specpipe_width_is_the_one_with_the_smallest_expected_time_between_tokens():
    from specctl.pipeline.plan import WidthOption, pick_width

    # E(T) = t + (1 - P) m t: w=1 50 + 0.4*4*50 = 130; w=4 52 + 0.2*4*52 = 93.6; w=8 60 + 0.17*4*60 = 100.8
    rows, best = pick_width(4, [WidthOption(1, 50, 0.6), WidthOption(4, 52, 0.8), WidthOption(8, 60, 0.83)])
    assert [r["expected_tbt_ms"] for r in rows] == [130.0, 93.6, 100.8] and best == 4
    assert pick_width(2, [WidthOption(1, 10, 1.0), WidthOption(2, 10, 1.0)])[1] == 1  # a tie: the narrower
    # A refill of D levels: each miss's output also decides the next i tokens with probability
    # P^i, at no step of their own: w=4, D=3: 52 (1 + 0.2*4 - 0.8 (1 - 0.8^3)) = 52 * 1.4096 = 73.2992
    rows, _ = pick_width(4, [WidthOption(4, 52, 0.8)], refill=3)
    assert rows[0]["expected_tbt_ms"] == 73.299
    # the same sum written out: misses per token 0.2, each saving 0.8 + 0.64 + 0.512 steps
    assert WidthOption(4, 52, 0.8).expected_tbt_ms(4, 3) == pytest.approx(52 * (1 + 0.2 * 4 - 0.2 * (0.8 + 0.64 + 0.512)))
    assert WidthOption(4, 52, 0.8).expected_tbt_ms(4, 0) == WidthOption(4, 52, 0.8).expected_tbt_ms(4)


def test_plan_pipeline_command_json_and_its_errors():
    def plan(*args):
        return run_here("plan", "--pipeline", *args)

    proc = plan("--stages", "4", "--widths", "1,4", "--step-ms", "50,52", "--hit", "0.6,0.8", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["best_width"] == 4
    bad = plan("--widths", "1,2", "--step-ms", "5", "--hit", "0.5,0.6")
    assert bad.returncode == 2 and "need one value per width (2, 1, 2 given)" in bad.stderr + bad.stdout
    missing = run_here("plan", "--ts", "10")
    assert missing.returncode == 2 and "plan needs --ts, --tv, --beta and --depth" in missing.stderr + missing.stdout
