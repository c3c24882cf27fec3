"""spec.depth_tuning: each load's proposal depth, or plain rounds, learnt from the instance's own
rounds — the epochs, which rounds are measured, the arms tried and kept, the load's hold — and
through the round loop and a real draft server and target instance, exact whatever it chooses."""

import asyncio
import itertools

import pytest

from specctl.cluster.embedded import ClusterConfig, ClusterThread
from specctl.config import Config, build_config
from specctl.spec.decode import DecodeSession
from specctl.spec.depth_tuning import DepthTuner, PeakLoad, Ticket, acceptance, expected_tokens
from specctl.spec.drafters import ModelChainDrafter
from specctl.spec.params import SamplingParams
from specctl.spec.pays import PLAIN
from specctl.spec.rounds import InlineLane, LocalSpeculator, generate, run_inline, run_session
from specctl.spec.turns import SpeculationByLoad
from specctl.verify.client import remote_generate
from tests.test_rounds import _drained, _reference, _star, _stop, models  # noqa: F401 - models: a fixture
from tests.test_turns import PROMPT, _Recording


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


DRAFTED = {0: 6, 4: 4, 2: 2, PLAIN: 0}  # the drafter's own depth: 6


def _drive(tuner, sessions, seconds_by_arm, rounds, accept_all=False, prefills=()):
    """``rounds`` rounds of each of ``sessions`` sessions in turn (on the tuner's fake clock),
    each taking ``seconds_by_arm[arm]`` (the sessions' rounds side by side) and accepting none
    of its proposal (or all of it), as SpeculationByLoad reports them; each round's (epoch, arm).
    ``prefills``: (round, seconds): before that round a prompt's prefill held every session up
    that long, and was told."""
    last, arms, prefills = [None] * sessions, [], dict(prefills)
    for index in range(rounds):
        if index in prefills:
            tuner.clock.now += prefills[index]
            tuner.stalled(prefills[index])
        for s in range(sessions):
            if last[s] is not None:
                drafted = DRAFTED[last[s][0]]
                tuner.ended(last[s][1], drafted, drafted if accept_all else 0)
            depth, ticket = tuner.plan(last[s][1] if last[s] else None)
            arm = PLAIN if depth is None else depth
            last[s] = (arm, ticket)
            arms.append((ticket.epoch, arm))
            tuner.clock.now += seconds_by_arm[arm] / sessions
    return arms


def _fastest(tuner):
    """The arm the tuner rates fastest at its load now (the one it runs, unless probing another)."""
    rates = tuner.snapshot()["spec_depth_rates"]
    return max(rates, key=rates.get)


def _epochs(arms):
    """The arm of each epoch, in order (and that an epoch ran one arm throughout)."""
    by_epoch = {}
    for epoch, arm in arms:
        assert by_epoch.setdefault(epoch, arm) == arm
    return list(by_epoch.values())


def test_the_tuner_tries_every_arm_then_keeps_the_fastest_and_probes_the_runner_up():
    load = [2]
    tuner = DepthTuner(lambda: load[0], clock=_Clock(), min_epoch_s=0.0)
    epochs = _epochs(_drive(tuner, 2, {0: 1 / 2, 4: 1 / 3, 2: 1 / 2.5, PLAIN: 1.0}, 4 * 60))
    # every arm once, the drafter's own depth first, then the fastest (chains of at most 4)
    assert epochs[:6] == [0, 4, 2, PLAIN, 4, 4]
    assert epochs[6] == 2  # after two epochs on the fastest, an arm of one epoch measured (of those, the fastest)
    assert epochs.count(4) > 0.6 * len(epochs) and epochs[-1] == 4
    assert tuner.snapshot()["spec_depth_now"] == "4" and tuner.snapshot()["spec_depth_load"] == 2
    # nothing accepted: every round commits its bonus alone, and the rate is one over the round time (each
    # epoch's time holds its last rounds, still running as it ends: the same share of every arm's)
    rates = tuner.snapshot()["spec_depth_rates"]
    assert {arm: rates[arm] / rates["plain"] for arm in rates} == pytest.approx({"own": 2, "4": 3, "2": 2.5, "plain": 1}, rel=0.01)
    assert tuner.snapshot()["spec_depth_acceptance"] == [0.0]


class _SlowAtFirst(dict):
    """Round times by arm, but arm 2's first ``slow`` rounds take three times as long (prefills
    met by its first epoch)."""

    def __init__(self, times, slow):
        super().__init__(times)
        self.slow = slow

    def __getitem__(self, arm):
        if arm == 2 and self.slow > 0:
            self.slow -= 1
            return 3 * super().__getitem__(arm)
        return super().__getitem__(arm)


def test_an_arm_rated_low_on_one_unlucky_epoch_is_tried_again_and_kept_when_fastest():
    """Chains of 2 are fastest but their first epoch met slow rounds: rated below the others,
    they are probed again (the arm measured least), found fastest and kept. Probing only the
    runner-up (the drafter's own depth here) never tried them again."""
    tuner = DepthTuner(lambda: 2, clock=_Clock(), min_epoch_s=0.0)
    epochs = _epochs(_drive(tuner, 2, _SlowAtFirst({0: 1 / 2, 4: 1 / 3, 2: 1 / 4, PLAIN: 1.0}, slow=10), 4 * 60))
    assert epochs[:4] == [0, 4, 2, PLAIN] and epochs[4] == 4  # 2 rated on its slow epoch: 4 fastest for now
    assert _fastest(tuner) == "2" and epochs.count(2) > 0.5 * len(epochs) and epochs[-1] == 2


def test_plain_rounds_win_where_speculation_costs_more_than_it_commits():
    tuner = DepthTuner(lambda: 3, clock=_Clock(), min_epoch_s=0.0)
    epochs = _epochs(_drive(tuner, 3, {0: 1 / 1.2, 4: 1 / 1.4, 2: 1 / 1.5, PLAIN: 0.5}, 4 * 40))
    assert epochs[:5] == [0, 4, 2, PLAIN, PLAIN] and tuner.snapshot()["spec_depth_now"] == "plain"
    assert epochs.count(PLAIN) > 0.6 * len(epochs)


def test_a_draft_accepted_often_keeps_its_own_depth_though_its_rounds_take_longest():
    tuner = DepthTuner(lambda: 2, clock=_Clock(), min_epoch_s=0.0)
    # all accepted: a round commits its depth and the bonus, 7 / 1.0 s beats 5 / 0.8, 3 / 0.6 and 1 / 0.3
    epochs = _epochs(_drive(tuner, 2, {0: 1.0, 4: 0.8, 2: 0.6, PLAIN: 0.3}, 4 * 30, accept_all=True))
    assert epochs[:5] == [0, 4, 2, PLAIN, 0] and epochs.count(0) > 0.6 * len(epochs)
    rates = tuner.snapshot()["spec_depth_rates"]
    assert {arm: rates[arm] / rates["plain"] for arm in rates} == \
        pytest.approx({"own": 7 / 1.0 * 0.3, "4": 5 / 0.8 * 0.3, "2": 3 / 0.6 * 0.3, "plain": 1}, rel=0.01)


def test_a_prompt_s_prefill_is_left_out_of_the_epoch_it_held_up():
    """Every arm's rounds take as long; prefills (each as long as six rounds) fall in the drafter's
    own depth's epochs: left out, every arm is rated alike, and the own depth is kept as the first
    ranked of equals. Counted, the own depth was rated slowest and not kept."""
    tuner = DepthTuner(lambda: 2, clock=_Clock(), min_epoch_s=0.0)
    epochs = _epochs(_drive(tuner, 2, {0: 0.5, 4: 0.5, 2: 0.5, PLAIN: 0.5}, 120, prefills=[(1, 3.0), (5, 3.0)]))
    assert epochs[:5] == [0, 4, 2, PLAIN, 0] and epochs.count(0) > 0.6 * len(epochs)  # (the others probed now and then)
    assert len(set(tuner.snapshot()["spec_depth_rates"].values())) == 1  # one token a round, 0.5 s
    assert tuner.snapshot()["spec_depth_prefill_s"] == 6.0


def test_an_epoch_lasts_its_rounds_and_at_least_min_epoch_s():
    tuner = DepthTuner(lambda: 2, clock=_Clock(), min_epoch_s=2.0)
    _drive(tuner, 2, {0: 0.1, 4: 0.1, 2: 0.1, PLAIN: 0.1}, 12)  # 12 rounds a session in 1.2 s: one epoch
    assert tuner.epoch == 1 and tuner.rounds == 20 and tuner.measured == {}  # (each first round unmeasured, each last running)
    _drive(tuner, 2, {0: 0.1, 4: 0.1, 2: 0.1, PLAIN: 0.1}, 10)  # past 2 s: the next arm's epoch
    assert tuner.epoch == 2 and [len(e) for e in tuner.measured[2].values()] == [1]


def test_the_acceptance_model():
    assert acceptance([]) == []
    # position 1: 3 reached, 2 accepted; 2: 2 reached, both; 3: 2 reached (the third round drafted 2), 1 accepted
    assert acceptance([(2, 4), (4, 4), (0, 2)]) == [2 / 3, 1.0, 0.5, 1.0]
    assert expected_tokens([], 6) == 1.0 and expected_tokens([0.0], 6) == 1.0
    assert expected_tokens([0.5, 0.5], 2) == 1.75 and expected_tokens([1.0, 0.5], 3) == 1 + 1 + 0.5 + 0.25
    assert expected_tokens([0.5], 1.5) == pytest.approx(1 + 0.5 + 0.5 * 0.25)  # half of the second position


def test_a_session_s_first_round_of_an_epoch_and_a_stale_round_are_not_measured():
    tuner = DepthTuner(lambda: 1, clock=_Clock(), min_epoch_s=0.0)
    depth, first = tuner.plan(None)
    assert depth == 0 and first == Ticket(1, False)  # a new session's first round: its prefill, its catch-up
    tuner.clock.now = 2.0
    tuner.ended(first, 6, 2)
    _, second = tuner.plan(first)
    assert second == Ticket(1, True) and (tuner.rounds, tuner.ended_rounds, tuner.seconds) == (0, 1, 2.0)
    tuner.ended(second, 6, 6)
    assert (tuner.rounds, tuner.ended_rounds, tuner.drafted) == (1, 2, 12)
    tuner.ended(Ticket(0, True), 4, 1)  # a round of another epoch
    assert (tuner.rounds, tuner.ended_rounds, tuner.drafted) == (1, 2, 12)
    # every speculative round tells the acceptance rate: 9 accepted, 2 rounds stopped short
    assert list(tuner.accepted) == [(2, 6), (6, 6), (1, 4)]
    assert tuner.snapshot()["spec_depth_acceptance"] == [1.0, 0.667, 0.5, 1.0, 1.0, 1.0]


def test_a_new_load_starts_on_the_arm_the_nearest_measured_load_found_fastest():
    load = [4]
    tuner = DepthTuner(lambda: load[0], clock=_Clock(), hold_s=0.0, min_epoch_s=0.0)
    _drive(tuner, 4, {0: 1.0, 4: 0.5, 2: 1 / 3, PLAIN: 1 / 1.5}, 4 * 12)
    assert _fastest(tuner) == "2"
    assert tuner.order(4) == [0, 4, 2, PLAIN]  # the first load tries every arm; its own rates rank them (next_arm)
    assert tuner.order(6) == [2, PLAIN] and tuner.order(3) == [2, 4, 0]  # a later one: the best and its side's
    load[0] = 6
    assert tuner.plan(None)[0] == 2 and tuner.level == 6


def test_a_later_load_tries_only_the_nearest_load_s_best_and_the_arms_on_its_side():
    """Load 2 finds chains capped at 4 fastest; at 5 sessions every arm is slower, caps of 2
    fastest: load 5 tries 4, 2 and plain rounds and keeps 2, never the drafter's own depth;
    load 1 (fewer) tries 4 and the deeper own depth only."""
    load = [2]
    tuner = DepthTuner(lambda: load[0], clock=_Clock(), hold_s=0.0, min_epoch_s=0.0)
    _drive(tuner, 2, {0: 1 / 2, 4: 1 / 3, 2: 1 / 2.5, PLAIN: 1.0}, 4 * 12)
    assert _fastest(tuner) == "4"
    load[0] = 5
    epochs = _epochs(_drive(tuner, 5, {0: 1.0, 4: 1 / 1.5, 2: 1 / 2, PLAIN: 1 / 1.8}, 4 * 12))
    assert set(tuner.measured[5]) == {4, 2, PLAIN} and 0 not in epochs[1:]
    assert _fastest(tuner) == "2"
    load[0] = 1
    _drive(tuner, 1, {0: 1 / 4, 4: 1 / 3.5, 2: 1 / 2.5, PLAIN: 1 / 1.2}, 4 * 12)
    assert set(tuner.measured[1]) == {4, 0} and _fastest(tuner) == "own"
    report = tuner.report()  # a benchmark's record: every epoch each arm ran at each load, its rate there
    assert list(report) == ["1", "2", "5"] and list(report["5"]) == ["4", "2", "plain"]
    assert list(report["1"]) == ["own", "4"]
    assert sum(arm["epochs"] for arm in report["5"].values()) == sum(len(e) for e in tuner.measured[5].values())
    assert report["5"]["2"]["rate"] > report["5"]["4"]["rate"] > 0
    log = tuner.epoch_log()  # the same epochs, in order
    assert len(log) == sum(arm["epochs"] for arms in report.values() for arm in arms.values())
    assert [load for load, _ in itertools.groupby(entry["load"] for entry in log)] == [2, 5, 1]
    assert [entry["ended_s"] for entry in log] == sorted(entry["ended_s"] for entry in log)
    assert next(entry["arm"] for entry in log if entry["load"] == 5) == "4"  # load 2's best first
    at_2 = {arm: [e["round_ms"] for e in log if e["load"] == 2 and e["arm"] == arm] for arm in ("own", "4", "plain")}
    assert min(at_2["plain"]) > min(at_2["own"]) > max(at_2["4"]) > 0  # rounds of 1 s, 1/2 s, 1/3 s
    assert {entry["drafted"] for entry in log if entry["arm"] == "4"} == {4.0}


def test_the_load_holds_its_peak_through_a_gap_shorter_than_the_hold():
    clock = _Clock()
    peak = PeakLoad(1.0, clock)
    assert peak(4) == 4
    clock.now = 0.3
    assert peak(3) == 4  # a client between two requests
    clock.now = 0.9
    assert peak(4) == 4 and peak(5) == 5  # more at once
    clock.now = 1.85
    assert peak(3) == 5
    clock.now = 1.9
    assert peak(3) == 3  # a second at fewer: the load fell


def test_a_load_s_partial_epoch_counts_when_every_session_had_a_measured_round():
    load, clock = [2], _Clock()
    tuner = DepthTuner(lambda: load[0], clock=clock, hold_s=0.5, min_epoch_s=0.0)
    _drive(tuner, 2, {0: 0.5, 4: 1 / 3, 2: 0.4, PLAIN: 1.0}, 3)  # 2 measured rounds of 6 in the first epoch
    load[0] = 1
    clock.now += 1.0
    tuner.plan(None)
    assert [len(e) for e in tuner.measured[2].values()] == [1] and tuner.level == 1 and tuner.epoch == 2
    load[0] = 2
    clock.now += 1.0
    tuner.plan(None)  # nothing measured at load 1: nothing kept
    assert 1 not in tuner.measured and tuner.level == 2


def test_in_one_process_a_draft_server_s_prefills_reach_every_target_s_tuner(tiny_dir):
    """The one-process cluster runs every role on one compute thread: a draft server's prompt
    prefill holds up each target's rounds, so each target's tuner is told of it."""
    config = build_config(None, target=str(tiny_dir["llama"]), draft=f"{tiny_dir['llama']}@2", mode="chain", depth=3,
                          dtype="fp32", draft_quant="none", spec_depth_by_load="auto")
    thread = ClusterThread(config, ClusterConfig(targets=2, gateway_port=0))
    thread.start()
    try:
        cluster = thread.cluster
        tuners = [target.depth_tuner for target in cluster.targets]
        assert len(tuners) == 2 and all(tuners)
        assert cluster.draft_server.prefill_listeners == [tuner.stalled for tuner in tuners]
    finally:
        thread.stop()


def test_depth_by_load_auto_is_a_configuration():
    config = Config(spec_depth_by_load="auto")
    assert config.depth_auto and config.depth_schedule == ()
    assert config.load_plan == {"spec_max_sessions": 0, "spec_depth_by_load": (), "spec_depth_auto": True}
    assert Config(spec_depth_by_load="3:4").load_plan["spec_depth_auto"] is False


@pytest.mark.parametrize("sessions", [1, 3])
def test_rounds_planned_by_the_tuner_keep_the_output_and_the_draft_learns_every_token(tiny, sessions):
    """Whatever arm the tuner takes each epoch (the load says ``sessions``: epochs of
    (EPOCH_ROUNDS + 1) x sessions rounds of this one session), the target's own text."""
    target, draft = tiny["llama"], tiny["llama-draft"]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    alone = generate(target, PROMPT, params)[0]
    lane, drafter = InlineLane(), _Recording(ModelChainDrafter(draft, 6))
    tuner = DepthTuner(lambda: sessions, min_epoch_s=0.0)  # (a tiny model's rounds take milliseconds)
    speculator = SpeculationByLoad(LocalSpeculator(drafter, lane), lambda: 0, tuner)
    session = DecodeSession(target, PROMPT, params, max_nodes=speculator.max_nodes)
    results = []
    run_inline(run_session(session, speculator, lane, lambda tokens, result: results.append(result)))
    results = [r for r in results if r is not None]
    assert session.output == alone
    assert tuner.epoch >= 2 and session.stats.load_rounds == sum(r.by_load for r in results)
    # the prompt's prefill, timed on the compute thread, told the tuner once
    assert 0 < session.stats.prefill_compute_s <= session.stats.prefill_s
    assert tuner.stalled_s == session.stats.prefill_compute_s
    assert all(text == session.seq[:len(text)] for text in drafter.texts)
    if sessions == 1:  # epochs of 4 rounds: the own depth, then chains of at most 4, 2, then plain rounds
        assert max(r.depth for r in results[:4]) > 4 and all(r.depth <= 4 for r in results[4:8])
        assert all(r.depth <= 2 for r in results[8:12]) and all(r.by_load for r in results[12:16])
        assert not any(r.by_load for r in results[:12])


@pytest.mark.asyncio
async def test_a_target_learning_its_depth_by_load_serves_the_target_s_text_and_frees_its_sessions(models):  # noqa: F811
    draft_server, link, target_server, port = await _star(models, ModelChainDrafter(models[1].decoder, 4),
                                                          spec_depth_auto=True)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    prompts = [[5, 9, 13, 2], [7, 8, 9, 10, 7, 8, 9], [3, 3, 4, 5]]
    told = []  # the draft's prompts prefilled 3 tokens a job: 0:3 | 0:3, 3:6 | 0:3 (the rest with the first proposal)
    draft_server.prefill_listeners.append(told.append)
    chunk, models[1].decoder.prefill_chunk = models[1].decoder.prefill_chunk, 3
    try:
        results = await asyncio.gather(*(remote_generate("127.0.0.1", port, p, params) for p in prompts))
        await _drained(draft_server, target_server)
        snapshot = target_server.snapshot()
    finally:
        models[1].decoder.prefill_chunk = chunk
        await _stop(draft_server, link, target_server)
    assert len(told) == 4 and all(seconds > 0 for seconds in told)
    assert snapshot["spec_depth_prefill_s"] > 0  # the target's own prefills, one job each
    assert [r[0] for r in results] == [_reference(models, p, params) for p in prompts]
    assert snapshot["spec_depth_epochs"] >= 1 and snapshot["spec_depth_now"] in ("own", "4", "2", "plain")
    assert snapshot["spec_depth_cap"] in (0, 4, 2, PLAIN)
    assert snapshot["load_rounds"] == sum(r[2]["load_rounds"] for r in results)
