"""Pre-speculation's trials: on, off, then the faster mode kept, then tried again."""

from specctl.draft.trial import KEEP_ROUNDS, TRIAL_ROUNDS, Trial, Trials, keep_prespec, load_level


def test_keep_prespec_compares_tokens_per_second():
    assert keep_prespec(100, 10.0, 90, 10.0)  # 10/s against 9/s
    assert not keep_prespec(100, 12.5, 90, 10.0)  # 8/s against 9/s
    assert keep_prespec(100, 10.0, 100, 10.0)  # a tie keeps it
    assert keep_prespec(0, 0.0, 90, 10.0) and keep_prespec(90, 10.0, 0, 0.0)  # nothing measured: keep


def run_phase(trial: Trial, rounds: int, tokens: int, seconds: float) -> list[bool]:
    modes = []
    for _ in range(rounds):
        on = trial.next_round()
        modes.append(on)
        trial.record(on, tokens, seconds)
    return modes


def test_a_trial_measures_both_modes_and_keeps_the_faster():
    trial = Trial()
    assert run_phase(trial, TRIAL_ROUNDS, 4, 0.5) == [True] * TRIAL_ROUNDS  # 8 tokens/s with
    assert run_phase(trial, TRIAL_ROUNDS, 4, 0.4) == [False] * TRIAL_ROUNDS  # 10 tokens/s without
    assert run_phase(trial, KEEP_ROUNDS, 4, 0.4) == [False] * KEEP_ROUNDS  # kept off
    snap = trial.snapshot()
    assert snap == {"phase": "keep", "kept": False, "tokens_per_s_on": 8.0, "tokens_per_s_off": 10.0, "decisions": 1}
    # then tried again from scratch, and this time it pays
    assert run_phase(trial, TRIAL_ROUNDS, 6, 0.5) == [True] * TRIAL_ROUNDS
    assert run_phase(trial, TRIAL_ROUNDS, 4, 0.5) == [False] * TRIAL_ROUNDS
    assert run_phase(trial, 3, 6, 0.5) == [True] * 3
    assert trial.snapshot()["kept"] is True and trial.snapshot()["decisions"] == 2


def test_load_levels_are_powers_of_two():
    assert [load_level(n) for n in range(0, 10)] == [1, 1, 2, 4, 4, 8, 8, 8, 8, 16]


def test_each_load_level_keeps_its_own_decision():
    trials = Trials()
    for sessions, seconds in ((1, 0.4), (3, 0.5)):  # faster with it at one session, without at three
        for phase_seconds in (seconds, 0.45):
            for _ in range(TRIAL_ROUNDS):
                on, level = trials.next_round(sessions)
                trials.record(level, on, 4, phase_seconds)
    assert trials.next_round(1) == (True, 1) and trials.next_round(3) == (False, 4) and trials.next_round(4) == (False, 4)
    assert trials.next_round(2)[0] is True  # a level never measured starts its trial with it on
    snap = trials.snapshot()
    assert list(snap) == ["1", "2", "4"] and (snap["1"]["kept"], snap["4"]["kept"]) == (True, False)
    trials.record(8, True, 4, 0.1)  # a level without a trial: nothing to record into
    assert list(trials.snapshot()) == ["1", "2", "4"]
