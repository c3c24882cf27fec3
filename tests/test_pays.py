"""Whether speculating pays for a session (spec.pays): the pure choice, the gate's measuring
(the first round not counted, probes), and a MultiDrafter that routes to no drafter where plain
rounds commit faster — its output still the target's own."""

from specctl.spec.drafters import Drafter, DraftSession, ModelChainDrafter, NgramDrafter
from specctl.spec.multi import MultiDrafter
from specctl.spec.pays import (PLAIN, PROBE_EVERY, SPEC_FIRST, TOP, WINDOW, PaysGate, arms, next_arm, probe_after, rate,
                              as_seen)
from specctl.spec.rounds import generate
from specctl.spec.routing import NONE, RoutingPolicy
from specctl.spec.params import SamplingParams

SPEC = 0  # a drafter's arm


def test_rate_is_committed_tokens_per_second_over_the_rounds():
    assert rate([(3, 1.0), (1, 1.0)]) == 2.0
    assert rate([]) == 0.0 and rate([(2, 0.0)]) == 0.0


def _next(spec, plain, current, streak):
    return next_arm({SPEC: spec, PLAIN: plain}, [SPEC, PLAIN], current, streak)


def test_speculate_until_measured_then_probe_plain_once_then_take_the_faster():
    assert SPEC_FIRST == 2
    assert _next([], [], None, 0) == SPEC
    assert _next([(4, 1.0)], [], SPEC, 2) == SPEC  # one measured speculative round is not enough
    assert _next([(4, 1.0), (4, 1.0)], [], SPEC, 3) == PLAIN  # plain never tried: try it
    assert _next([(4, 1.0)] * 2, [(1, 0.5)], PLAIN, 1) == SPEC  # 4 tok/s against 2
    assert _next([(2, 1.0)] * 2, [(1, 0.25)], PLAIN, 1) == PLAIN  # 2 tok/s against 4
    assert _next([(2, 1.0)] * 2, [(1, 0.5)], SPEC, 1) == SPEC  # a tie goes to the better-ranked


def test_the_runner_up_is_tried_again_sooner_the_fewer_rounds_it_was_judged_on():
    assert [probe_after(n) for n in (0, 1, 2, 4, WINDOW)] == [2, 2, 4, 8, PROBE_EVERY]
    spec, plain = [(4, 1.0)] * 2, [(1, 0.5)]
    assert _next(spec, plain, SPEC, 1) == SPEC
    assert _next(spec, plain, SPEC, 2) == PLAIN  # plain judged on one round
    assert _next(spec, plain, PLAIN, 1) == SPEC  # the probe was one round: back to the faster
    assert _next(spec, [(1, 0.5)] * WINDOW, SPEC, PROBE_EVERY - 1) == SPEC
    assert _next(spec, [(1, 0.5)] * WINDOW, SPEC, PROBE_EVERY) == PLAIN
    slow = [(1, 1.0)] * 2
    assert _next(slow, plain, PLAIN, 3) == PLAIN
    assert _next(slow, plain, PLAIN, 4) == SPEC  # speculation judged on two rounds
    assert _next(slow, plain, SPEC, 1) == PLAIN


def test_several_drafters_are_tried_in_rank_order_then_the_fastest_leads():
    order = [2, 0, PLAIN]  # drafter 2 ranked first by its routing score
    assert next_arm({}, order, None, 0) == 2
    assert next_arm({2: [(3, 1.0)] * 2}, order, 2, 3) == 0  # every other arm is measured once
    measured = {2: [(3, 1.0)] * 2, 0: [(8, 2.0)]}
    assert next_arm(measured, order, 0, 1) == PLAIN
    measured[PLAIN] = [(1, 0.5)]
    assert next_arm(measured, order, PLAIN, 1) == 0  # 4 tok/s against 3 and 2: the lower-ranked drafter leads
    assert next_arm(measured, order, 0, 3) == 0
    assert next_arm(measured, order, 0, 4) == 2  # the runner-up (3 tok/s, two rounds), not plain
    assert next_arm(measured, [0], 0, PROBE_EVERY) == 0  # one arm: nothing to choose


def test_a_session_judges_an_arm_by_its_own_rounds_once_it_has_any_else_by_the_pooled_ones():
    pooled = [(4, 1.0)] * (WINDOW + 2)
    assert as_seen([], pooled) == [(4, 1.0)] * WINDOW
    assert as_seen([(1, 1.0)], pooled) == [(1, 1.0)]
    assert as_seen([], []) == []


def test_a_new_session_starts_on_the_arm_the_targets_sessions_measured_fastest():
    order = [2, 0, PLAIN]  # drafter 2 ranked first by its routing score
    pooled = {2: [(1, 1.0)] * WINDOW, 0: [(8, 2.0)] * WINDOW, PLAIN: [(1, 0.5)] * WINDOW}
    assert next_arm({}, order, None, 0) == 2  # without a prior: the best-ranked, measured first
    assert next_arm({}, order, None, 0, pooled) == 0  # 4 tok/s against 1 and 2: no arm tried anew
    assert next_arm({}, order, None, 0, {0: [(8, 2.0)]}) == 2  # arms the pool has not seen are tried as before
    # the runner-up (plain, 2 tok/s) is probed by the session's own count: after 2 rounds, not PROBE_EVERY
    assert next_arm({0: [(4, 1.0)]}, order, 0, 1, pooled) == 0
    assert next_arm({0: [(4, 1.0)] * 2}, order, 0, 2, pooled) == PLAIN
    # this text is not drafter 0's: one round of its own replaces the pool's 4 tok/s
    assert next_arm({0: [(1, 1.0)]}, order, 0, 1, pooled) == PLAIN  # 1 tok/s against plain's pooled 2


def test_a_session_tries_a_free_drafter_itself_though_the_pool_knows_it():
    order = [2, 0, PLAIN]  # drafter 2 (free, the n-gram lookup) ranked first on the score's tie
    pooled = {2: [(1, 1.0)] * WINDOW, 0: [(8, 2.0)] * WINDOW, PLAIN: [(1, 0.5)] * WINDOW}
    assert next_arm({}, order, None, 0, pooled) == 0  # the pool's fastest
    assert next_arm({}, order, None, 0, pooled, own_first=[2]) == 2  # but the free one is tried first, once
    # on this text it commits 6 tokens a second, against the pool's 4 for drafter 0: it leads
    assert next_arm({2: [(6, 1.0)]}, order, 2, 1, pooled, own_first=[2]) == 2
    assert next_arm({2: [(2, 1.0)]}, order, 2, 1, pooled, own_first=[2]) == 0  # here it does not


def test_the_gates_of_a_targets_sessions_pool_what_they_measured():
    pooled: dict = {}
    first, second = PaysGate(pooled=pooled), PaysGate(pooled=pooled)
    _round(first, 0.0, 9.0, 2)  # the first round (prompt prefill) is measured by neither
    assert pooled == {}
    for i in range(3):
        arm = first.begin([SPEC, PLAIN], 10.0 + i)
        first.end(1, 10.25 + i) if arm == PLAIN else first.end(2, 11.0 + i)
    assert {arm: list(rounds) for arm, rounds in pooled.items()} == {SPEC: [(first, (2, 1.0))] * 2,
                                                                     PLAIN: [(first, (1, 0.25))]}
    assert list(second.measured) == []  # a session's own rounds stay its own
    _round(second, 20.0, 9.0, 2)
    assert second.begin([SPEC, PLAIN], 30.0) == PLAIN  # the pool's 4 tok/s against 2: no speculative trials
    second.end(1, 30.5)
    assert list(pooled[PLAIN]) == [(first, (1, 0.25)), (second, (1, 0.5))]
    assert list(second.measured[PLAIN]) == [(1, 0.5)]
    for i in range(3 * WINDOW):
        _round(second, 40.0 + i, 0.25, 1)
    # the pool keeps the last WINDOW rounds of each arm (equal rates: the better-ranked leads)
    assert len(pooled[SPEC]) == WINDOW and len(pooled[PLAIN]) <= WINDOW


def test_the_arms_are_each_drafter_up_or_the_top_scored_then_none():
    assert arms([2, 0], by_rate=True, plain=True) == [2, 0, PLAIN]
    assert arms([2, 0], by_rate=False, plain=True) == [TOP, PLAIN]
    assert arms([2, 0], by_rate=True, plain=False) == [2, 0]
    assert arms([], by_rate=True, plain=True) == [TOP, PLAIN]  # every drafter down: the router says so
    assert RoutingPolicy(plain_arm=False, by_rate=False).measures is False and RoutingPolicy().measures


def _round(gate: PaysGate, now: float, seconds: float, tokens: int) -> int:
    arm = gate.begin([SPEC, PLAIN], now)
    gate.end(tokens, now + seconds)
    return arm


def test_the_gate_skips_the_first_round_and_settles_on_the_faster_arm():
    gate, now, taken = PaysGate(), 0.0, []
    # speculative rounds: 2 tokens in 1 s (the first, with the draft's prompt prefill, took 9 s);
    # plain rounds: 1 token in 0.25 s
    for _ in range(8):
        arm = gate.begin([SPEC, PLAIN], now)
        seconds = 0.25 if arm == PLAIN else 9.0 if not taken else 1.0
        gate.end(2 if arm == SPEC else 1, now + seconds)
        taken.append(arm)
        now += seconds
    # speculation judged on two rounds is tried again after 4 plain ones
    assert taken == [SPEC, SPEC, SPEC, PLAIN, PLAIN, PLAIN, PLAIN, SPEC]
    assert list(gate.measured[SPEC]) == [(2, 1.0)] * 3 and list(gate.measured[PLAIN]) == [(1, 0.25)] * 4
    # 6 more plain rounds in a row (three speculative ones measured): speculation is tried once,
    # and measured: 10 tokens in 1 s lifts its window's rate (16 tokens / 4 s) to plain's
    for _ in range(probe_after(3)):
        assert _round(gate, now, 0.25, 1) == PLAIN
    assert _round(gate, now, 1.0, 10) == SPEC and list(gate.measured[SPEC])[-1] == (10, 1.0)
    assert _round(gate, now, 1.0, 1) == SPEC  # chosen on 16 tokens / 4 s (a tie); then 17 / 5 s
    assert gate.begin([SPEC, PLAIN], now) == PLAIN and gate.plain  # plain's 4 tokens a second is faster again


def test_a_round_with_a_drafters_first_draft_is_not_measured():
    gate = PaysGate()
    _round(gate, 0.0, 9.0, 2)  # the session's first
    gate.begin([SPEC, PLAIN], 10.0)
    gate.uncounted()  # e.g. a model drafter drafting here for the first time: its prompt prefill
    gate.end(2, 15.0)
    assert SPEC not in gate.measured
    _round(gate, 20.0, 1.0, 3)
    assert list(gate.measured[SPEC]) == [(3, 1.0)]


def test_a_multi_drafter_round_with_predicted_rounds_after_it_is_not_measured(tiny):
    """A request's prediction drafts the rounds between: the time from this round's asking to its
    outcome is theirs too (spec.prediction tells the draft session ``rounds_between``)."""
    clock = _FakeClock()
    drafter = MultiDrafter({"self": _Costly(ModelChainDrafter(tiny["llama"], 4), clock, 0.05)}, clock=clock)
    session = drafter.open(64)
    try:
        seq = [7, 8, 9, 10] * 3
        for between in (False, False, True, False):
            session.propose(seq, SamplingParams(), None)
            if between:
                session.rounds_between()
            session.on_verified([])
            seq = seq + [3]
        # the first round holds the prompt prefill; of the other three the one with rounds between is left out
        assert sum(len(rounds) for rounds in session.gate.measured.values()) == 2
    finally:
        session.close()


def test_the_window_keeps_the_last_rounds_only():
    gate = PaysGate()
    for i in range(WINDOW + 3):
        gate.begin([SPEC], float(i))
        gate.end(i, i + 1.0)
    assert [tokens for tokens, _ in gate.measured[SPEC]] == list(range(3, WINDOW + 3))


class _FakeClock:
    """Seconds that pass only when told: verification costs 0.1 s a call, drafting what the drafter says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.1
        return self.now


class _Costly(Drafter):
    """A drafter whose every proposal costs ``seconds`` of the fake clock."""

    def __init__(self, inner: Drafter, clock: _FakeClock, seconds: float) -> None:
        self.inner, self.clock, self.seconds = inner, clock, seconds
        self.max_nodes = inner.max_nodes
        self.told = 0  # outcomes it heard

    def open(self, capacity, pool=None):
        inner, owner = self.inner.open(capacity, pool), self

        class _Session(DraftSession):
            def propose(self, seq, params, generator):
                owner.clock.now += owner.seconds
                return inner.propose(seq, params, generator)

            def on_verified(self, path):
                owner.told += 1
                inner.on_verified(path)

            def close(self):
                inner.close()

        return _Session()


def test_a_session_routes_to_no_drafter_where_plain_rounds_commit_faster(tiny):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = [5, 9, 13, 2]
    reference, plain_stats, _ = generate(tiny["llama"], prompt, params)
    clock = _FakeClock()
    slow = _Costly(ModelChainDrafter(tiny["llama-draft"], 4), clock, 5.0)  # a random draft that costs 5 s a round
    drafter = MultiDrafter({"slow": slow}, clock=clock)
    output, stats, _ = generate(tiny["llama"], prompt, params, drafter)
    assert output == reference
    snapshot = drafter.snapshot()
    plain_rounds = snapshot[NONE]["chosen_rounds"]
    assert plain_rounds > stats.rounds // 2 and snapshot["slow"]["chosen_rounds"] + plain_rounds == stats.rounds
    # plain rounds are nobody's to hear about (the last round's outcome comes with no next proposal)
    assert snapshot["slow"]["chosen_rounds"] - 1 <= slow.told <= snapshot["slow"]["chosen_rounds"]


def test_a_session_keeps_speculating_where_it_pays_and_without_the_plain_arm(tiny):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = [7, 8, 9, 10] * 6
    reference = generate(tiny["llama"], prompt, params)[0]
    clock = _FakeClock()
    # the target drafting for itself: every token accepted, cheap
    drafter = MultiDrafter({"self": _Costly(ModelChainDrafter(tiny["llama"], 4), clock, 0.05)}, clock=clock)
    output, stats, _ = generate(tiny["llama"], prompt, params, drafter)
    assert output == reference
    # plain decoding tried after 2 measured speculative rounds, then probed again 2 rounds later
    # (judged on one round); the rest speculative
    assert stats.rounds == 10 and stats.drafts == 8 and drafter.snapshot()[NONE]["chosen_rounds"] == 2
    never = MultiDrafter({"ngram": NgramDrafter(3)}, policy=RoutingPolicy(plain_arm=False))
    assert generate(tiny["llama"], prompt, params, never)[0] == reference and NONE not in never.snapshot()


def test_the_drafter_whose_rounds_commit_fastest_leads_though_the_score_ties(tiny):
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    prompt = [7, 8, 9, 10] * 6
    reference = generate(tiny["llama"], prompt, params)[0]
    one_a_round = dict(alpha=0.0, beta=0.0, free_riders=False)

    def drafters(clock):  # the target drafting for itself: every token accepted, so both score 1.0
        return {"slow": _Costly(ModelChainDrafter(tiny["llama"], 4), clock, 5.0),
                "fast": _Costly(ModelChainDrafter(tiny["llama"], 2), clock, 0.01)}

    clock = _FakeClock()
    by_rate = MultiDrafter(drafters(clock), policy=RoutingPolicy(**one_a_round), clock=clock)
    output, stats, _ = generate(tiny["llama"], prompt, params, by_rate)
    assert output == reference
    led = by_rate.snapshot()
    # slow first (ranked first on the tie: the session's first round, then measured twice), then
    # fast once and plain once; fast from then on, with plain (the runner-up) probed after 2, 4, 6 rounds
    assert led["slow"]["chosen_rounds"] == 3 and led[NONE]["chosen_rounds"] == 3
    assert led["fast"]["chosen_rounds"] == stats.rounds - 6
    clock = _FakeClock()
    by_score = MultiDrafter(drafters(clock), policy=RoutingPolicy(**one_a_round, by_rate=False, plain_arm=False),
                            clock=clock)
    assert generate(tiny["llama"], prompt, params, by_score)[0] == reference
    assert by_score.snapshot()["fast"]["chosen_rounds"] == 0  # the score alone never sees the cost


def test_later_sessions_of_a_target_do_not_try_the_costly_drafter_again(tiny):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [[7, 8, 9, 10] * 6, [3, 4, 5, 6] * 6, [11, 12, 13] * 8]
    references = [generate(tiny["llama"], prompt, params)[0] for prompt in prompts]
    one_a_round = dict(alpha=0.0, beta=0.0, free_riders=False)

    def slow_rounds(pooled: bool) -> list[int]:
        clock = _FakeClock()
        slow = _Costly(ModelChainDrafter(tiny["llama"], 4), clock, 5.0)  # every token accepted, 5 s a round
        fast = _Costly(ModelChainDrafter(tiny["llama"], 2), clock, 0.01)
        drafter = MultiDrafter({"slow": slow, "fast": fast}, policy=RoutingPolicy(**one_a_round, pooled=pooled),
                               clock=clock)
        counts = []
        for prompt, reference in zip(prompts, references):
            before = drafter.snapshot()["slow"]["chosen_rounds"]
            assert generate(tiny["llama"], prompt, params, drafter)[0] == reference
            counts.append(drafter.snapshot()["slow"]["chosen_rounds"] - before)
        return counts

    # each session on its own tries slow (ranked first on the score's tie) three times; with the
    # pool only the first session does: the later ones start on fast, and their runner-up is plain
    assert slow_rounds(pooled=False) == [3, 3, 3]
    assert slow_rounds(pooled=True) == [3, 0, 0]
