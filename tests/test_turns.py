"""Rounds a speculator sits out (spec.turns): plain rounds while a target instance runs more
sessions than spec_max_sessions, exact whatever the load does, with the draft told every
token committed meanwhile; the catch-up's bookkeeping; the stats; through a real draft
server and target instance."""

import asyncio
from types import SimpleNamespace

import pytest

from specctl.config import Config, parse_depth_schedule
from specctl.errors import ConfigError
from specctl.spec.decode import DecodeSession
from specctl.spec.drafters import Drafter, DraftSession, ModelChainDrafter, ModelTreeDrafter
from specctl.spec.params import SamplingParams
from specctl.spec.prediction import with_prediction
from specctl.spec.rounds import InlineLane, LocalSpeculator, generate, run_inline, run_session
from specctl.spec.turns import InnerTurns, LoadHold, SpeculationByLoad, depth_for_load
from specctl.verify.client import remote_generate
from specctl.verify.server import TargetServerConfig
from tests.test_rounds import _drained, _reference, _star, _stop, models  # noqa: F401 - models: a fixture

PROMPT = [1, 5, 9, 2, 7]


def _session(seq, prompt_len, last_committed, last_path=()):
    return SimpleNamespace(seq=list(seq), prompt_len=prompt_len, last_committed=list(last_committed),
                           last_path=list(last_path))


def test_the_inner_speculator_hears_nothing_after_its_own_round_and_everything_after_sitting_out():
    turns = InnerTurns()
    # after the prefill (prompt of 3, first token 7): nothing came between
    assert turns.outcome(_session([1, 2, 3, 7], 3, [7])) is None
    turns.round_ended([0, 1])  # its proposal: two nodes accepted, then the bonus
    assert turns.outcome(_session([1, 2, 3, 7, 8, 9, 4], 3, [8, 9, 4], [0, 1])) is None  # its own round again
    turns.round_ended([0])  # ... one node accepted of its next proposal
    turns.round_ended([])  # a round it sat out (the wrapper answered): its path is not the inner's
    told = turns.outcome(_session([1, 2, 3, 7, 8, 9, 4, 5, 6, 11], 3, [11]))
    assert told == ([0], [5, 6, 11])  # its proposal's accepted path, then every token since it proposed at 7 tokens
    turns.round_ended([2])
    # a round another wrapper answered came between (the prediction's): told that round's tokens too
    assert turns.outcome(_session([1, 2, 3, 7, 8, 9, 4, 5, 6, 11, 12, 13], 3, [13])) == ([2], [12, 13])


def test_a_speculator_that_never_proposed_hears_the_whole_output_since_the_prompt():
    turns = InnerTurns()
    turns.round_ended([])  # not asked yet: nothing of its own
    assert turns.outcome(_session([1, 2, 3, 7, 8, 9], 3, [9])) == ([], [7, 8, 9])


class _Recording(Drafter):
    """A real drafter whose sessions record the text they are asked to draft from."""

    def __init__(self, inner: Drafter) -> None:
        self.inner, self.max_nodes, self.texts = inner, inner.max_nodes, []

    def open(self, capacity, pool=None):
        inner, texts = self.inner.open(capacity, pool), self.texts

        class _Session(DraftSession):
            @property
            def depth_cap(self):
                return inner.depth_cap

            @depth_cap.setter
            def depth_cap(self, value):  # the round's cap reaches the chain session
                inner.depth_cap = value

            def propose(self, seq, params, generator):
                texts.append(list(seq))
                return inner.propose(seq, params, generator)

            def on_verified(self, path):
                inner.on_verified(path)

            def rounds_between(self):
                pass

            def close(self):
                inner.close()

        return _Session()


def _run_by_load(target, draft, params, loads, tree=False):
    """Greedy rounds with a chain (or tree) draft 4 deep, each round planned as ``loads`` says
    (True: a plain round, False: any depth, an int: at most that deep; then any depth); (the
    session, the drafter, each round's result)."""
    lane, pattern = InlineLane(), iter(loads)
    drafter = _Recording(ModelTreeDrafter(draft, 4, 2, 3) if tree else ModelChainDrafter(draft, 4))

    def plan():
        load = next(pattern, False)
        return None if load is True else int(load)

    speculator = with_prediction(SpeculationByLoad(LocalSpeculator(drafter, lane), plan), params)
    session = DecodeSession(target, PROMPT, params, max_nodes=speculator.max_nodes)
    results = []
    run_inline(run_session(session, speculator, lane, lambda tokens, result: results.append(result)))
    return session, drafter, [r for r in results if r is not None]


@pytest.mark.parametrize("loads", [
    [True] * 6,  # loaded from the start: the draft's first proposal comes after six plain rounds
    [False, False, True, True, True, False, True, False, False, True, True],
    [False, True] * 12,
])
def test_plain_rounds_by_load_keep_the_output_and_the_draft_learns_every_token(tiny, loads):
    target, draft = tiny["llama"], tiny["llama-draft"]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = generate(target, PROMPT, params)[0]
    session, drafter, results = _run_by_load(target, draft, params, loads)
    assert session.output == alone
    shed = [r.by_load for r in results]
    assert shed[:len(loads)] == loads[:len(shed)] and not any(shed[len(loads):])
    assert all(r.depth == 0 and r.nodes == 0 for r in results if r.by_load)
    assert session.stats.load_rounds == sum(shed) and session.stats.fallback_rounds == 0
    assert session.stats.to_dict()["load_rounds"] == sum(shed)
    # the draft drafts from the session's own text every time (a token missed in a catch-up would not be a prefix)
    assert drafter.texts and all(text == session.seq[:len(text)] for text in drafter.texts)
    assert len(drafter.texts) == len(results) - sum(shed)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_proposals_capped_by_load_keep_the_output_and_never_pass_their_cap(tiny, tree):
    target, draft = tiny["llama"], tiny["llama-draft"]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = generate(target, PROMPT, params)[0]
    caps = [2, 1, 3, 0, 2, 2, 1, 0, 0, 1] * 3  # 0: the drafter's own depth, 4
    session, drafter, results = _run_by_load(target, draft, params, caps, tree)
    assert session.output == alone and session.stats.load_rounds == 0
    assert [r.depth <= (c or 4) for r, c in zip(results, caps)] == [True] * min(len(results), len(caps))
    assert any(r.depth == 4 for r, c in zip(results, caps) if c == 0)
    assert all(text == session.seq[:len(text)] for text in drafter.texts)


def test_a_capped_chain_in_a_batch_stops_at_its_cap_and_the_others_draft_on(tiny):
    from specctl.spec.batch_drafting import propose_chains

    draft = tiny["llama-draft"]
    greedy = SamplingParams(max_tokens=8)
    drafter = ModelChainDrafter(draft, 4)
    texts = [[1, 5, 9, 2, 7], [3, 4, 5, 6]]
    full = [propose_chains([drafter.open(64)], [text], [greedy], [None])[0].tree.tokens for text in texts]
    sessions = [drafter.open(64), drafter.open(64)]
    sessions[0].depth_cap = 2
    capped, uncapped = propose_chains(sessions, texts, [greedy, greedy], [None, None])
    assert list(capped.tree.tokens) == list(full[0][:3]) and list(uncapped.tree.tokens) == list(full[1])
    assert sessions[0].cache.length == len(texts[0]) + 1  # the text and the first drafted token (the second unfed)
    both = [drafter.open(64), drafter.open(64)]
    for session in both:
        session.depth_cap = 3  # one cap for the batch: its chains read back once, at the end
    assert [list(p.tree.tokens) for p in propose_chains(both, texts, [greedy, greedy], [None, None])] == \
        [list(tokens[:4]) for tokens in full]


def test_a_capped_tree_in_a_batch_is_the_uncapped_tree_s_first_levels_and_the_others_grow_on(tiny):
    from specctl.spec.batch_drafting import propose_trees

    draft = tiny["llama-draft"]
    greedy = SamplingParams(max_tokens=8)
    drafter = ModelTreeDrafter(draft, 4, 2, 3)
    texts = [[1, 5, 9, 2, 7], [3, 4, 5, 6]]
    full = [propose_trees([drafter.open(64)], [text], [greedy], [None])[0].tree for text in texts]
    assert [int(tree.max_depth) for tree in full] == [4, 4]
    sessions = [drafter.open(64), drafter.open(64)]
    sessions[0].depth_cap = 2
    capped, uncapped = (p.tree for p in propose_trees(sessions, texts, [greedy, greedy], [None, None]))
    shallow = int((full[0].depth <= 2).sum())  # levels are appended in order: the first two are a prefix
    assert int(capped.max_depth) == 2 and list(capped.tokens) == list(full[0].tokens[:shallow])
    assert list(capped.parents) == list(full[0].parents[:shallow])
    assert list(uncapped.tokens) == list(full[1].tokens) and list(uncapped.parents) == list(full[1].parents)
    # the capped tree's KV holds the text and its first level, fed to grow the second
    assert sessions[0].cache.length == len(texts[0]) + int((full[0].depth == 1).sum())


def test_a_negative_max_depth_is_refused_and_the_rest_of_its_batch_is_drafted(tiny):
    from specctl.draft.sessions import SessionTable
    from specctl.engine.kv_cache import KVPool
    from specctl.errors import BadRequest
    from specctl.net.protocol import OpenSession, Proposal as ProposalMsg

    draft = tiny["llama-draft"]
    table = SessionTable(ModelChainDrafter(draft, 4), KVPool(None), draft.spec.vocab_size, draft.spec.max_position)
    for tag, prompt in ((1, [5, 6, 7]), (2, [9, 3, 4, 1])):
        table.open(tag, OpenSession(0, prompt, max_tokens=16))
    bad, good = table.propose_many([(1, [], [8], -1), (2, [], [8], 2)])
    assert isinstance(bad, BadRequest) and str(bad) == "max_depth must be >= 0 (0: the draft's own depth), got -1"
    assert isinstance(good, ProposalMsg) and len(good.tokens) == 3  # the root and a chain of 2
    assert table.states[1].seq == [5, 6, 7] and table.states[1].last_tree is None  # the outcome was not applied
    assert isinstance(table.propose_many([(1, [], [8])])[0], ProposalMsg)  # and the session goes on


def test_the_depth_for_a_load_is_the_largest_threshold_reached():
    schedule = ((4, 4), (6, 2))
    assert [depth_for_load(n, schedule) for n in (1, 3, 4, 5, 6, 9)] == [0, 0, 4, 4, 2, 2]
    assert depth_for_load(9, ()) == 0
    assert parse_depth_schedule(" 4:4, 6:2 ") == schedule and parse_depth_schedule("") == ()
    for bad in ("4", "4:0", "0:3", "6:2,4:4", "4:4,4:2", "a:b", "4:65"):
        with pytest.raises(ConfigError, match="spec_depth_by_load must be SESSIONS:DEPTH pairs"):
            parse_depth_schedule(bad)
    with pytest.raises(ConfigError, match="got '4:x'"):
        Config(spec_depth_by_load="4:x")


def test_plain_rounds_by_load_between_predicted_rounds_keep_the_output(tiny):
    target, draft = tiny["llama"], tiny["llama-draft"]
    alone = generate(target, PROMPT, SamplingParams(max_tokens=64, ignore_eos=True))[0]
    edited = alone[:12] + alone[40:]  # predicted rounds, the draft's (or plain ones by load), predicted again
    params = SamplingParams(max_tokens=64, ignore_eos=True, prediction=tuple(edited))
    session, drafter, results = _run_by_load(target, draft, params, [False, True, True, False, True] * 8)
    assert session.output == alone
    assert any(r.predicted for r in results) and any(r.by_load for r in results)
    assert drafter.texts and all(text == session.seq[:len(text)] for text in drafter.texts)


def test_an_instance_stays_loaded_for_the_hold_after_it_last_ran_past_its_limit():
    now = [0.0]
    hold = LoadHold(3, hold_s=1.0, clock=lambda: now[0])
    assert hold(3) is False  # at the limit: speculation pays
    assert hold(4) is True and hold.held() is True
    now[0] = 0.5
    assert hold(3) is True  # a dip (a client between two requests): still loaded
    now[0] = 1.2
    assert hold(4) is True  # loaded again: the hold runs from here
    now[0] = 2.1
    assert hold(2) is True
    now[0] = 2.3
    assert hold(2) is False and hold.held() is False  # a second without more than 3 sessions: speculating again


def test_spec_max_sessions_is_checked():
    assert Config(spec_max_sessions=3).spec_max_sessions == 3
    with pytest.raises(ConfigError, match=r"spec_max_sessions must be an integer in \[0, 1048576\], got -1"):
        Config(spec_max_sessions=-1)
    with pytest.raises(ValueError, match=r"spec_max_sessions must be >= 0 \(0: always speculate\), got -1"):
        TargetServerConfig(spec_max_sessions=-1)


async def _two_sessions(models, spec_max_sessions, tree=False, **options):  # noqa: F811 - models: the fixture's value
    drafter = ModelTreeDrafter(models[1].decoder, 4, 2, 3) if tree else ModelChainDrafter(models[1].decoder, 4)
    draft_server, link, target_server, port = await _star(models, drafter, spec_max_sessions=spec_max_sessions,
                                                          **options)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [[5, 9, 13, 2], [7, 8, 9, 10, 7, 8, 9]]
    try:
        results = await asyncio.gather(*(remote_generate("127.0.0.1", port, p, params) for p in prompts))
        await _drained(draft_server, target_server)
        return [r[0] for r in results], [r[2] for r in results], target_server.snapshot(), \
            [_reference(models, p, params) for p in prompts]
    finally:
        await _stop(draft_server, link, target_server)


@pytest.mark.asyncio
async def test_a_seeded_sample_speculates_whatever_the_load_so_its_seed_repeats_the_text(models):  # noqa: F811
    """A plain round draws other random numbers than a speculative one: shedding a seeded
    sample's rounds by load would make its text depend on the other requests."""
    draft_server, link, target_server, port = await _star(models, ModelChainDrafter(models[1].decoder, 4),
                                                          spec_max_sessions=1)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    seeded = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, seed=5)
    try:
        (_, _, greedy_stats), (loaded_text, _, seeded_stats) = await asyncio.gather(
            remote_generate("127.0.0.1", port, [5, 9, 13, 2], greedy),
            remote_generate("127.0.0.1", port, [7, 8, 9, 10, 7, 8, 9], seeded))
        alone_text, _, _ = await remote_generate("127.0.0.1", port, [7, 8, 9, 10, 7, 8, 9], seeded)
        await _drained(draft_server, target_server)
    finally:
        await _stop(draft_server, link, target_server)
    assert greedy_stats["load_rounds"] > 0 and seeded_stats["load_rounds"] == 0
    assert seeded_stats["drafts"] == seeded_stats["rounds"] and loaded_text == alone_text


@pytest.mark.asyncio
async def test_a_target_past_its_spec_max_sessions_runs_plain_rounds_and_frees_every_draft_session(models):  # noqa: F811
    outputs, stats, snapshot, references = await _two_sessions(models, 1)
    assert outputs == references
    assert sum(s["load_rounds"] for s in stats) > 0 and snapshot["load_rounds"] == sum(s["load_rounds"] for s in stats)
    assert snapshot["spec_max_sessions"] == 1 and all(s["fallback_rounds"] == 0 for s in stats)


@pytest.mark.asyncio
async def test_a_target_within_its_spec_max_sessions_speculates_every_round(models):  # noqa: F811
    outputs, stats, snapshot, references = await _two_sessions(models, 2)
    assert outputs == references
    assert snapshot["load_rounds"] == 0 and all(s["drafts"] == s["rounds"] for s in stats)
    assert snapshot["spec_held"] is False


@pytest.mark.asyncio
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
async def test_a_target_asks_its_draft_server_for_shorter_proposals_as_its_load_grows(models, tree):  # noqa: F811
    outputs, stats, snapshot, references = await _two_sessions(models, 0, tree, spec_depth_by_load=((1, 3), (2, 1)))
    assert outputs == references and snapshot["load_rounds"] == 0
    assert all(s["drafts"] == s["rounds"] and max(s["accepted_per_pos"] + [0]) for s in stats)
    # proposals 1 deep while both ran, at most 3 once one had finished; never the draft's 4
    assert all(len(s["accepted_per_pos"]) <= 3 for s in stats) and all(s["drafted"] <= 3 * s["drafts"] for s in stats)
    assert any(s["drafted"] < 2 * s["drafts"] for s in stats)
