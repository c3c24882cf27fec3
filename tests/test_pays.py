"""Whether speculating pays for a session (spec.pays): the pure choice, the gate's measuring
(the first round not counted, probes), and a MultiDrafter that routes to no drafter where plain
rounds commit faster — its output still the target's own."""

from specctl.spec.drafters import Drafter, DraftSession, ModelChainDrafter, NgramDrafter
from specctl.spec.multi import MultiDrafter
from specctl.spec.pays import PROBE_EVERY, SPEC_FIRST, WINDOW, PaysGate, rate, speculate_next
from specctl.spec.rounds import generate
from specctl.spec.routing import NONE, RoutingPolicy
from specctl.spec.sampling import SamplingParams


def test_rate_is_committed_tokens_per_second_over_the_rounds():
    assert rate([(3, 1.0), (1, 1.0)]) == 2.0
    assert rate([]) == 0.0 and rate([(2, 0.0)]) == 0.0


def test_speculate_until_measured_then_probe_plain_once_then_take_the_faster():
    assert SPEC_FIRST == 2
    assert speculate_next([], [], None, 0) is True
    assert speculate_next([(4, 1.0)], [], True, 2) is True  # one measured speculative round is not enough
    assert speculate_next([(4, 1.0), (4, 1.0)], [], True, 3) is False  # plain never tried: try it
    assert speculate_next([(4, 1.0)] * 2, [(1, 0.5)], False, 1) is True  # 4 tok/s against 2
    assert speculate_next([(2, 1.0)] * 2, [(1, 0.25)], False, 1) is False  # 2 tok/s against 4
    assert speculate_next([(2, 1.0)] * 2, [(1, 0.5)], True, 1) is True  # a tie speculates


def test_after_probe_every_rounds_on_one_arm_the_other_is_tried_once():
    spec, plain = [(4, 1.0)] * 2, [(1, 0.5)]
    assert speculate_next(spec, plain, True, PROBE_EVERY - 1) is True
    assert speculate_next(spec, plain, True, PROBE_EVERY) is False
    assert speculate_next(spec, plain, False, 1) is True  # the probe was one round: back to the faster
    slow = [(1, 1.0)] * 2
    assert speculate_next(slow, plain, False, PROBE_EVERY) is True
    assert speculate_next(slow, plain, True, 1) is False


def _round(gate: PaysGate, now: float, seconds: float, tokens: int) -> bool:
    arm = gate.begin(now)
    gate.end(tokens, now + seconds)
    return arm


def test_the_gate_skips_the_first_round_and_settles_on_the_faster_arm():
    gate, now, arms = PaysGate(), 0.0, []
    # speculative rounds: 2 tokens in 1 s (the first, with the draft's prompt prefill, took 9 s);
    # plain rounds: 1 token in 0.25 s
    for _ in range(6):
        arm = gate.begin(now)
        seconds = 0.25 if not arm else 9.0 if not arms else 1.0
        gate.end(2 if arm else 1, now + seconds)
        arms.append(arm)
        now += seconds
    assert arms == [True, True, True, False, False, False]
    assert list(gate.spec) == [(2, 1.0), (2, 1.0)] and list(gate.plain) == [(1, 0.25)] * 3
    # PROBE_EVERY plain rounds in a row: speculation is tried once, and measured: 10 tokens in
    # 1 s lifts its window's rate (14 tokens / 3 s) over plain's 4 tokens a second
    while gate.streak < PROBE_EVERY:
        assert _round(gate, now, 0.25, 1) is False
    assert _round(gate, now, 1.0, 10) is True and list(gate.spec)[-1] == (10, 1.0)
    assert _round(gate, now, 1.0, 1) is True  # chosen on 14 tokens / 3 s; then 15 / 4 s
    assert gate.begin(now) is False  # plain's 4 tokens a second is faster again


def test_the_window_keeps_the_last_rounds_only():
    gate = PaysGate()
    assert gate.spec.maxlen == gate.plain.maxlen == WINDOW


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
    assert drafter.snapshot()[NONE]["chosen_rounds"] == 1  # the one probe of plain decoding
    never = MultiDrafter({"ngram": NgramDrafter(3)}, policy=RoutingPolicy(plain_arm=False))
    assert generate(tiny["llama"], prompt, params, never)[0] == reference and NONE not in never.snapshot()
