"""Several drafters in one session (CoSine routing + fusion): exact against the target alone,
a drafter dying mid-run changes nothing, sampling keeps the target's distribution, stats."""

import pytest

from specctl.engine.kv_cache import KVPool
from specctl.spec.drafters import Drafter, DraftSession, ModelChainDrafter, ModelTreeDrafter, NgramDrafter
from specctl.spec.multi import GREEDY, MultiDrafter
from specctl.spec.decode import DecodeSession
from specctl.spec.rounds import InlineLane, LocalSpeculator, generate, run_inline, run_session
from specctl.spec.turns import SpeculationByLoad
from specctl.spec.routing import RoutingPolicy
from specctl.spec.params import SamplingParams
from tests.test_sampling_exact import _assert_target_distribution, small  # noqa: F401 - the fixture

PROMPTS = [[5, 9, 13, 2], [7, 8, 9, 10] * 6, list(range(30, 70)), [100]]


class _Dying(Drafter):
    """Wraps a drafter; its sessions fail every proposal from the ``after``-th on."""

    def __init__(self, inner: Drafter, after: int) -> None:
        self.inner, self.after = inner, after
        self.max_nodes = inner.max_nodes

    def open(self, capacity, pool=None):
        inner, after = self.inner.open(capacity, pool), self.after

        class _Session(DraftSession):
            calls = 0

            def propose(self, seq, params, generator):
                self.calls += 1
                if self.calls >= after:
                    raise ConnectionError("draft server gone")
                return inner.propose(seq, params, generator)

            def on_verified(self, path):
                inner.on_verified(path)

            def close(self):
                inner.close()

        return _Session()


def _multi(tiny, arch, **kw):
    return MultiDrafter({"draft": ModelChainDrafter(tiny[f"{arch}-draft"], 4),
                         "self2": ModelChainDrafter(tiny[f"{arch}-self2"], 3),
                         "ngram": NgramDrafter(4)}, **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_with_three_drafters_equals_the_target_alone(tiny, arch):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    drafter = _multi(tiny, arch)
    for prompt in PROMPTS:
        reference = generate(tiny[arch], prompt, params)[0]
        output, stats, _ = generate(tiny[arch], prompt, params, drafter)
        assert output == reference, prompt
    snapshot = drafter.snapshot()
    assert sum(s["chosen_rounds"] for s in snapshot.values()) > 0
    assert all(s["failures"] == 0 for s in snapshot.values())
    assert sum(s["accepted_tokens"] for s in snapshot.values()) > 0


def test_a_cap_reaches_every_drafter_and_the_output_stays_the_targets(tiny):
    """The target's load caps a several-drafter session's proposals: each of its drafters keeps
    to the cap (their fused tree too), and the output is the target alone's."""
    from specctl.spec.draft_state import DraftState

    target, params = tiny["llama"], SamplingParams(max_tokens=30, ignore_eos=True)
    drafter = _multi(tiny, "llama", budget=12)
    for prompt in PROMPTS:
        session = drafter.open(len(prompt) + 64)
        state = DraftState(session, params, None, list(prompt) + [7], len(prompt) + 64, drafter.max_nodes,
                           target.spec.vocab_size)
        state.cap_depth(2)
        assert session.depth_cap == 2 and all(s.depth_cap == 2 for s in session.sessions)
        assert session.propose(state.seq, params, None).tree.max_depth <= 2
        session.close()
    for prompt in PROMPTS[:2]:  # a round loop planning every round at most 2 deep
        lane, results = InlineLane(), []
        speculator = SpeculationByLoad(LocalSpeculator(drafter, lane), lambda: 2)
        session = DecodeSession(target, prompt, params, max_nodes=speculator.max_nodes)
        run_inline(run_session(session, speculator, lane, lambda tokens, result: results.append(result)))
        assert session.output == generate(target, prompt, params)[0]
        drafted = [r.depth for r in results if r is not None]
        assert max(drafted) == 2 and all(depth <= 2 for depth in drafted)


def test_always_fusing_every_drafter_is_exact_and_credits_each(tiny):
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    everyone = RoutingPolicy(tau=100.0, alpha=1.0, beta=1.0, plain_arm=False)  # two drafters a round, always
    drafter = MultiDrafter({"draft": ModelChainDrafter(tiny["llama-draft"], 4), "ngram": NgramDrafter(4)},
                           policy=everyone)
    rounds = 0
    for prompt in PROMPTS:
        output, stats, _ = generate(tiny["llama"], prompt, params, drafter)
        assert output == generate(tiny["llama"], prompt, params)[0]
        rounds += stats.rounds
    snapshot = drafter.snapshot()
    # the model drafter proposed every round; the n-gram lookup in the rounds where it found a match
    assert snapshot["draft"]["chosen_rounds"] == rounds > snapshot["ngram"]["chosen_rounds"] > 0


def test_an_ngram_lookup_without_a_match_passes_the_round_to_the_model_drafter(tiny):
    one_a_round = RoutingPolicy(alpha=0.0, beta=0.0, free_riders=False)
    drafter = MultiDrafter({"draft": ModelChainDrafter(tiny["llama-draft"], 4), "ngram": NgramDrafter(4)},
                           policy=one_a_round)
    session = drafter.open(64)
    try:
        text = list(range(30, 40))  # no token repeats: the n-gram lookup (ranked first, untried) finds nothing
        assert len(session.propose(text, GREEDY, None).tree) == 5
        assert drafter.snapshot()["draft"]["chosen_rounds"] == 1 and drafter.snapshot()["ngram"]["chosen_rounds"] == 0
        session.on_verified([])
        # 35 was seen before: the lookup proposes what followed it, and the model drafter is not asked
        assert session.propose(text + [35], GREEDY, None).tree.tokens.tolist() == [35, 36, 37, 38, 39]
        assert drafter.snapshot()["draft"]["chosen_rounds"] == 1 and drafter.snapshot()["ngram"]["chosen_rounds"] == 1
    finally:
        session.close()


def test_a_drafter_dying_mid_run_is_skipped_and_output_unchanged(tiny):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    always_both = RoutingPolicy(tau=100.0, alpha=1.0, beta=1.0)
    drafter = MultiDrafter({"remote": _Dying(ModelChainDrafter(tiny["llama-draft"], 4), after=3),
                            "self2": ModelChainDrafter(tiny["llama-self2"], 3)}, policy=always_both)
    pool = KVPool()
    for prompt in PROMPTS:
        reference = generate(tiny["llama"], prompt, params)[0]
        assert generate(tiny["llama"], prompt, params, drafter, draft_pool=pool)[0] == reference
    assert drafter.snapshot()["remote"]["failures"] > 0
    assert pool.used_bytes == 0 and pool.sessions == 0


def test_all_drafters_failing_falls_back_to_plain_decoding(tiny):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    drafter = MultiDrafter({"gone": _Dying(NgramDrafter(3), after=1)})
    output, stats, _ = generate(tiny["llama"], PROMPTS[1], params, drafter)
    assert output == generate(tiny["llama"], PROMPTS[1], params)[0] and stats.accepted == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_tree_drafter_fused_with_chains_equals_the_target_alone_and_is_credited(tiny, arch):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    everyone = RoutingPolicy(tau=100.0, alpha=1.0, beta=1.0)  # the tree and a chain every round, the lookup too
    drafter = MultiDrafter({"tree": ModelTreeDrafter(tiny[f"{arch}-self2"], 3, 2, 6),
                            "chain": ModelChainDrafter(tiny[f"{arch}-draft"], 4), "ngram": NgramDrafter(4)},
                           policy=everyone, budget=12)
    pool = KVPool()
    for prompt in PROMPTS:
        reference = generate(tiny[arch], prompt, params)[0]
        assert generate(tiny[arch], prompt, params, drafter, draft_pool=pool)[0] == reference, prompt
    snapshot = drafter.snapshot()
    assert snapshot["tree"]["chosen_rounds"] > 0 and snapshot["tree"]["accepted_tokens"] > 0
    assert snapshot["tree"]["proposed_tokens"] > snapshot["tree"]["chosen_rounds"] * 3  # more than one path a round
    assert all(s["failures"] == 0 for s in snapshot.values())
    assert pool.used_bytes == 0 and pool.sessions == 0


def test_a_tree_drafter_is_told_its_own_nodes_of_the_verified_path(tiny):
    """The tree drafter's session hears the verified path in its own numbering, not the fused
    tree's: it then drafts exactly what a tree drafter alone drafts after the same round."""
    make = lambda: ModelTreeDrafter(tiny["llama-self2"], 3, 2, 6)  # noqa: E731
    drafter = MultiDrafter({"tree": make(), "ngram": NgramDrafter(3)},
                           policy=RoutingPolicy(tau=100.0, alpha=1.0, beta=1.0))
    session, alone = drafter.open(128), make().open(128)
    try:
        text = [5, 9, 13, 2, 5, 9]  # the lookup proposes 13, 2, 5 (what followed 5, 9 before)
        tree = session.propose(text, GREEDY, None).tree
        asked = {i: (draft, where) for i, draft, where in session.asked}
        (draft, where), (lookup, _) = asked[0], asked[1]
        assert lookup.tokens == [13, 2, 5]
        assert alone.propose(text, GREEDY, None).tree.tokens[1:].tolist() == draft.tokens
        # Verification takes the tree drafter's second root child, then its first child.
        second = [i + 1 for i, parent in enumerate(draft.parents) if parent == 0][1]
        below = [i + 1 for i, parent in enumerate(draft.parents) if parent == second][0]
        path = [where[second - 1], where[below - 1]]
        assert path != [second, below]  # the fused numbering differs from the drafter's own
        session.on_verified(path)
        alone.on_verified([second, below])
        assert session.scores[0].total == 2.0 and session.scores[1].total == 0.0  # the lookup's were rejected
        after = text + [int(tree.tokens[path[0]]), int(tree.tokens[path[1]]), 77]  # and the bonus
        assert (session.sessions[0].propose(after, GREEDY, None).tree.tokens.tolist()
                == alone.propose(after, GREEDY, None).tree.tokens.tolist())
    finally:
        session.close()
        alone.close()


def test_bad_budgets_are_refused(tiny):
    with pytest.raises(ValueError, match="at least one drafter"):
        MultiDrafter({})
    with pytest.raises(ValueError, match="budget must be >= 1"):
        MultiDrafter({"ngram": NgramDrafter(3)}, budget=0)


@pytest.mark.slow
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.85)])
def test_fused_sampling_keeps_the_target_distribution(small, temperature, top_p):  # noqa: F811
    target, draft = small
    drafter = MultiDrafter({"draft": ModelChainDrafter(draft, 2), "ngram": NgramDrafter(2)},
                           policy=RoutingPolicy(tau=100.0, alpha=1.0, beta=1.0))
    _assert_target_distribution(target, drafter, temperature, top_p)


@pytest.mark.slow
def test_fused_sampling_with_a_tree_drafter_keeps_the_target_distribution(small):  # noqa: F811
    target, draft = small
    drafter = MultiDrafter({"tree": ModelTreeDrafter(draft, 2, 2, 4), "ngram": NgramDrafter(2)},
                           policy=RoutingPolicy(tau=100.0, alpha=1.0, beta=1.0))
    _assert_target_distribution(target, drafter, 0.8, 1.0)


@pytest.mark.slow  # `up --drafters` (tests/test_up.py) runs the same drafters from the command line
def test_generate_mode_multi_from_the_command_line(tiny_dir):
    import json

    from tests.test_cli import _assert_one_line_error, _generate

    reference = json.loads(_generate(tiny_dir, "--mode", "ar").stdout)["token_ids"]
    proc = _generate(tiny_dir, "--mode", "multi", "--drafters", f"{tiny_dir['llama-draft']},ngram")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["token_ids"] == reference and set(result["drafters"]) == {str(tiny_dir["llama-draft"]), "ngram", "none"}
    _assert_one_line_error(_generate(tiny_dir, "--mode", "multi"), "mode multi needs drafters")


@pytest.mark.slow  # a benchmark command run end to end (11 s); routing and fusion are tested in-process by default
def test_bench_drafters_measures_singles_routing_and_fusion_with_exact_outputs(tiny_dir, tmp_path):
    import json

    from tests.test_cli import run

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello world hello world", "kind": "edit"}\n{"prompt": "abc def", "kind": "code"}\n')
    out = tmp_path / "d.json"
    proc = run("bench", "drafters", "--target", str(tiny_dir["llama"]), "--drafters",
               f"{tiny_dir['llama-draft']},ngram", "--prompts", str(prompts), "-n", "12", "--dtype", "fp32",
               "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert list(report["modes"]) == ["ar", str(tiny_dir["llama-draft"]), "ngram", "routing", "routing+fusion",
                                     "routing+fusion, own rates", "routing+fusion by score"]
    assert all(m["outputs_equal_to_ar"] == 1.0 for m in report["modes"].values())
    against = report["against_best_single"]
    assert against["best_single"] in (str(tiny_dir["llama-draft"]), "ngram")
    assert set(against["routing+fusion"]["per_kind"]) == {"code", "edit"}
    assert against["ceiling_best_per_class_or_ar"] >= against["ceiling_best_per_class"] >= 1.0
    assert report["drafters"]["routing+fusion"]["ngram"]["chosen_rounds"] > 0  # the repeated prompt matches
    assert "none" in report["drafters"]["routing+fusion"] and "none" in report["drafters"]["routing+fusion by score"]


def test_the_routing_ceiling_serves_each_class_with_its_fastest_arm():
    from specctl.bench.drafters import per_class_best_rate

    row = lambda rate: {"tokens_per_s": rate, "new_tokens": 10}  # noqa: E731
    modes = {"a": {"per_kind": {"x": row(2.0), "y": row(1.0)}}, "b": {"per_kind": {"x": row(1.0), "y": row(5.0)}}}
    assert per_class_best_rate(modes, ["a", "b"], ["x", "y"]) == pytest.approx(20 / 7)  # x on a: 5 s, y on b: 2 s
    assert per_class_best_rate(modes, ["a"], ["x", "y"]) == pytest.approx(20 / 15)
    assert per_class_best_rate(modes, ["a", "missing"], ["x"]) == 2.0


def test_bench_drafters_needs_two_drafters():
    from tests.conftest import run_here
    from tests.test_cli import _assert_one_line_error

    _assert_one_line_error(run_here("bench", "drafters", "--drafters", "ngram"), "--drafters needs at least two drafters")


def test_the_mixed_workload_has_four_classes():
    from specctl.bench.prompts import load_prompts

    prompts = load_prompts("mixed")
    assert len(prompts) == 16 and [p.kind for p in prompts[:4]] == ["code", "prose", "edit", "summary"]
    assert {p.kind for p in prompts} == {"code", "prose", "edit", "summary"}
