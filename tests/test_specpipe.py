"""SpecPipe: a pipelined target fed one speculative tree level per step. Exact greedy
output over 2-4 stages and several widths; the target's distribution when sampling
(chi-square through 2 stages, and the one-node acceptance rule alone); the tree's
bookkeeping (masks over cached ancestors, kept positions on a re-rooting)."""

import asyncio

import pytest
import torch

from specctl.engine.loader import LoadedModel, load_decoder, load_model
from specctl.engine.tiny import make_tiny_model
from specctl.pipeline.live_tree import CacheMirror, SpecTree
from specctl.pipeline.local import LocalPipeline
from specctl.pipeline.specpipe import SpecPipeRun, specpipe_generate
from specctl.pipeline.token_source import DraftLevels, TreeShape, max_tree_nodes, spread_level
from specctl.spec.decode import DecodeSession
from specctl.spec.rounds import generate
from specctl.spec.params import SamplingParams
from specctl.spec.verify import accept_at_node
from tests.conftest import wait_until
from tests.test_sampling_exact import (PROMPT as SMALL_PROMPT, VOCAB, _exact_joint_of_tokens_3_and_4,
                                      assert_counts_match)

PROMPTS = [[5, 9, 13, 2], [7, 8, 9, 10, 7, 8, 9], [42, 43, 44, 45, 46]]


def test_a_level_sees_its_cached_ancestors_and_a_reroot_keeps_the_subtree():
    tree = SpecTree()
    root = tree.add(10, None, 5)
    a, b = tree.add(11, root, 6), tree.add(12, root, 6)
    mirror = CacheMirror(prefix=5)
    mirror.append([root, a, b])
    c, d = tree.add(13, a, 7), tree.add(14, b, 7)
    assert mirror.level_mask(tree, [c, d]).tolist() == [[True, True, False, True, False],
                                                        [True, False, True, False, True]]
    mirror.append([c, d])
    keep = mirror.reroot(tree, root, a)  # root committed; a and its child c stay
    assert keep == [0, 1, 2, 3, 4, 5, 6, 8] and (mirror.prefix, mirror.order) == (6, [a, c])
    tree.reroot(a)
    assert sorted(tree.nodes) == [a, c] and tree.nodes[a].parent is None
    assert mirror.reroot(tree, a, None) == list(range(7)) and (mirror.prefix, mirror.order) == (7, [])
    with pytest.raises(ValueError, match="not the oldest cached tree node"):
        CacheMirror(3, [c]).reroot(tree, a, None)


def test_a_refill_forward_of_several_levels_sees_its_ancestors_among_its_own_rows():
    tree = SpecTree()
    root = tree.add(10, None, 5)
    a, b = tree.add(11, root, 6), tree.add(12, root, 6)
    c = tree.add(13, b, 7)
    mirror = CacheMirror(prefix=5)
    # The verified token and two levels under it as one forward (parents before children):
    # each row sees itself and its ancestors among the forward's own rows.
    assert mirror.level_mask(tree, [root, a, b, c]).tolist() == [[True, False, False, False],
                                                                 [True, True, False, False],
                                                                 [True, False, True, False],
                                                                 [True, False, True, True]]
    mirror.append([root, a, b, c])
    d = tree.add(14, c, 8)
    assert mirror.level_mask(tree, [d]).tolist() == [[True, False, True, True, True]]


def test_one_node_acceptance_draws_exactly_the_target_distribution():
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(5, dtype=torch.float64)
    accepted = 0
    for _ in range(6000):
        index, token = accept_at_node([3, 1], p, generator)
        counts[token] += 1
        accepted += index is not None
    assert 0 < accepted < 6000
    assert_counts_match(counts, p.double())


@pytest.fixture(scope="module")
def models(tiny_dir):
    return load_model("t", tiny_dir["llama"], "fp32"), load_model("d", tiny_dir["llama"], "fp32", num_layers=2)


# the default run: likeliest over 2 and 4 stages, every-node over 3; the other three in --runslow (CI's second pass)
@pytest.mark.parametrize("stages, spread", [
    (2, "likeliest"), (4, "likeliest"), (3, "every-node"),
    *(pytest.param(s, p, marks=pytest.mark.slow) for s, p in ((3, "likeliest"), (2, "every-node"), (4, "every-node")))])
async def test_specpipe_outputs_exactly_the_whole_target(models, stages, spread):
    target, draft = models
    async with LocalPipeline(target, stages) as pipeline:
        staged = pipeline.staged
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        hits = 0
        for prompt in PROMPTS:
            reference = generate(target.decoder, prompt, params)[0]
            for width in (1, 3):
                tokens, stats, reason, pipe = await asyncio.to_thread(
                    specpipe_generate, staged.decoder, draft.decoder, prompt, params, TreeShape(width, 2, spread))
                assert tokens == reference and reason == "length", (prompt, width)
                # The prefill is the first tree's root level: its output is a verification
                # too (of the draft's guesses at the first token), reported as the prefill's.
                assert pipe.steps == stats.rounds + 1 == 40 and pipe.hits + pipe.flushes <= pipe.steps
                assert stats.accepted <= pipe.hits <= stats.accepted + 1
                assert pipe.hit_rate == pipe.hits / pipe.steps
                if spread == "every-node":  # every node keeps its likeliest child: no level is pruned away whole
                    assert pipe.bubbles == 0
                hits += pipe.hits
        assert hits > 0  # the re-rooting path ran, not only flushes
        await wait_until(lambda: all(s.pool.sessions == 0 for s in pipeline.servers), what="stage KV freed")


@pytest.mark.parametrize("stages, refill", [(2, 0), (2, 1), (4, 0), (4, 1), (4, None), (4, 5)])
async def test_a_refill_decides_several_tokens_from_one_output_and_the_tokens_stay_the_whole_targets(
        models, stages, refill):
    """After a miss the verified token goes with ``refill`` levels drafted under it (None:
    stages - 1): their output decides the tokens through them while they hit. 0 is the
    token alone (one decision per output)."""
    target, draft = models
    shape = TreeShape(3, 2, refill=refill)
    depth = shape.refill_depth(stages)
    assert depth == (stages - 1 if refill is None else refill)
    async with LocalPipeline(target, stages) as pipeline:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        refills = chained = 0
        for prompt in PROMPTS:
            reference = generate(target.decoder, prompt, params)[0]
            tokens, stats, reason, pipe = await asyncio.to_thread(
                specpipe_generate, pipeline.staged.decoder, draft.decoder, prompt, params, shape)
            assert tokens == reference and reason == "length", prompt
            assert pipe.steps == stats.rounds + 1 == 40
            # Every miss is refilled (the draft is local, never lost) but one that ends the
            # session; a chained decision follows a hit inside a refill, at most ``depth`` per refill.
            misses = pipe.steps - pipe.hits
            assert (misses - 1 <= pipe.refills <= misses) if depth else pipe.refills == 0
            assert pipe.refill_tokens <= depth * pipe.refills
            refills, chained = refills + pipe.refills, chained + pipe.refill_tokens
        assert (refills > 0 and chained > 0) if depth else refills == chained == 0
        await wait_until(lambda: all(s.pool.sessions == 0 for s in pipeline.servers), what="stage KV freed")


def test_the_refill_depth_is_checked_and_sizes_the_cached_tree():
    assert TreeShape(4, 2).refill_depth(4) == 3 and TreeShape(4, 2).refill_depth(1) == 0
    assert max_tree_nodes(4, TreeShape(4, 2)) == (4 + 2 + 3) * 4 + 1
    assert max_tree_nodes(4, TreeShape(4, 2, refill=0)) == (4 + 2) * 4 + 1
    with pytest.raises(ValueError, match=r"^refill depth must be in 0\.\.16, got 17$"):
        TreeShape(4, 2, refill=17)


@pytest.mark.parametrize("width", [1, pytest.param(3, marks=pytest.mark.slow)])  # 9 s each
async def test_levels_left_dead_by_a_verification_are_dropped_by_the_stages_and_the_output_stays_exact(models, width):
    """With slow stages the levels of a flushed tree (or of a wholly pruned level) are still
    queued downstream when the verification happens: stage 1 declares them dead and the
    stages pass them on uncomputed; in levels that keep live nodes (width 3) the pruned rows
    are declared dead and not computed. The tokens stay the whole target's."""
    target, draft = models
    async with LocalPipeline(target, 4, delay_s=0.03) as pipeline:
        staged = pipeline.staged
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        declared, declared_rows = 0, 0
        for prompt in PROMPTS:
            reference = generate(target.decoder, prompt, params)[0]
            tokens, _, _, pipe = await asyncio.to_thread(
                specpipe_generate, staged.decoder, draft.decoder, prompt, params, TreeShape(width, 2))
            assert tokens == reference, prompt
            # Every stale or bubble output had been declared dead; no verified forward ever was
            # (a refill's forward holds several steps: those after its first are refill tokens).
            verified_forwards = pipe.steps - pipe.refill_tokens
            assert pipe.stale_outputs + pipe.bubbles <= pipe.levels_dropped <= pipe.levels_sent - verified_forwards
            declared += pipe.levels_dropped
            declared_rows += pipe.rows_dropped
        dropped = sum(server.stats.dropped_forwards for server in pipeline.servers)
        assert declared > 0 and dropped > 0, (declared, dropped)
        skipped = sum(server.stats.skipped_rows for server in pipeline.servers)
        if width == 1:
            assert declared_rows == skipped == 0  # a level of one node is live or dead as a whole
        else:
            assert declared_rows > 0 and skipped > 0, (declared_rows, skipped)
        await wait_until(lambda: all(s.pool.sessions == 0 for s in pipeline.servers), what="stage KV freed")
        assert all(worker.dead == {} for s in pipeline.servers for worker in s.workers)


@pytest.mark.parametrize("prompt", [[7], PROMPTS[1]], ids=["one-token-prompt", "prompt"])
async def test_the_draft_levels_follow_the_prefill_so_the_pipeline_is_full_at_the_first_token(models, prompt):
    """The prompt's last token is the first tree's root and the prefill its level: when the
    first token comes out, the prefill and n - 1 levels under the root were sent (the draft
    read the prompt but its last token; a one-token prompt: nothing before the root)."""
    target, draft = models
    async with LocalPipeline(target, 4) as pipeline:
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        session = DecodeSession(pipeline.staged.decoder, prompt, params, max_nodes=max_tree_nodes(4, TreeShape(2, 2)))
        levels = DraftLevels.for_session(draft.decoder, TreeShape(2, 2), session)
        assert levels.mirror.prefix == levels.cache.length == len(prompt) - 1
        sent_at_emit = []
        run = SpecPipeRun(pipeline.staged.decoder, session, levels,
                          lambda tokens, result: sent_at_emit.append((len(tokens), result is None, run.stats.levels_sent)))
        await asyncio.to_thread(run.run)
        assert session.output == generate(target.decoder, prompt, params)[0]
        assert sent_at_emit[0] == (1, True, 4)  # the first token, reported as the prefill's, with 4 forwards sent
        assert all(not first for _, first, _ in sent_at_emit[1:]) and len(sent_at_emit) == 16
        assert run.stats.steps == session.stats.rounds + 1 == 16
        session.close()
        levels.close()
        await wait_until(lambda: all(s.pool.sessions == 0 for s in pipeline.servers), what="stage KV freed")


async def test_the_draft_levels_follow_the_requests_logit_rules_and_the_tokens_stay_the_targets(models):
    """With allowed_token_ids and a repetition penalty the target decides from its adjusted
    row; the draft's levels follow the same rules after each node's path (the session's
    rules, read): more hits than a draft drafting free, the same tokens either way."""
    target, draft = models
    allowed = tuple(range(40, 60))
    params = SamplingParams(max_tokens=24, ignore_eos=True, allowed_token_ids=allowed, repetition_penalty=1.3)
    shape = TreeShape(2, 2)
    hits = {}
    async with LocalPipeline(target, 2) as pipeline:
        for guided in (True, False):
            hits[guided] = 0
            for prompt in PROMPTS:
                session = DecodeSession(pipeline.staged.decoder, prompt, params, max_nodes=max_tree_nodes(2, shape))
                levels = DraftLevels.for_session(draft.decoder, shape, session)
                assert levels.guide is session.rules
                if not guided:
                    levels.guide = None
                run = SpecPipeRun(pipeline.staged.decoder, session, levels)
                try:
                    await asyncio.to_thread(run.run)
                    assert session.output == generate(target.decoder, prompt, params)[0], (prompt, guided)
                    assert set(session.output) <= set(allowed)
                finally:
                    session.close()
                    levels.close()
                hits[guided] += run.stats.hits
    assert hits[True] > hits[False], hits


async def test_specpipe_stops_at_a_stop_token_like_the_target(models):
    target, draft = models
    async with LocalPipeline(target, 2) as pipeline:
        staged = pipeline.staged
        reference = generate(target.decoder, PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))[0]
        params = SamplingParams(max_tokens=20, stop_token_ids=(reference[7],))
        expected, _, expected_reason = generate(target.decoder, PROMPTS[0], params)
        tokens, _, reason, _ = await asyncio.to_thread(specpipe_generate, staged.decoder, draft.decoder, PROMPTS[0],
                                                       params, TreeShape(2, 2))
        assert (tokens, reason) == (expected, expected_reason) == (reference[:7], "stop")


@pytest.mark.slow
@pytest.mark.parametrize("prediction", [(), (1, 4, 2, 3, 5, 0, 1)], ids=["levels", "predicted-chain"])
async def test_specpipe_sampling_keeps_the_target_distribution(tmp_path, prediction):
    """Tokens 3 and 4 (decided by SpecPipe steps: re-rootings, refills and decisions chained
    through a refill's output; with a prediction, by its chain's nodes among the candidates)
    through 2 stages: chi-square against the target's exact joint distribution on a 6-token
    vocabulary."""
    kw = dict(vocab_size=VOCAB, layers=2, hidden=32, eos_token_id=None, init_std=0.3)
    path = make_tiny_model(tmp_path / "t", "llama", seed=11, **kw)
    decoder = load_decoder(path)  # no tokenizer for a 6-token vocabulary: the fingerprint is given
    target = LoadedModel("t", path, decoder.spec, decoder, None, _fingerprint="six-tokens")
    draft = load_decoder(make_tiny_model(tmp_path / "d", "llama", seed=12, **kw))
    async with LocalPipeline(target, 2) as pipeline:
        staged = pipeline.staged
        expected = _exact_joint_of_tokens_3_and_4(target.decoder, SamplingParams(temperature=1.0))

        def sample_all():
            counts, hits, chained, predicted = torch.zeros(VOCAB, VOCAB, dtype=torch.float64), 0, 0, 0
            for seed in range(1200):
                params = SamplingParams(temperature=1.0, max_tokens=4, seed=seed, prediction=prediction)
                out, _, _, pipe = specpipe_generate(staged.decoder, draft, SMALL_PROMPT, params,
                                                    TreeShape(2, 2))
                counts[out[2], out[3]] += 1
                hits, chained = hits + pipe.hits, chained + pipe.refill_tokens
                predicted += pipe.predicted_accepted
            return counts, hits, chained, predicted

        counts, hits, chained, predicted = await asyncio.to_thread(sample_all)
        assert hits > 0 and chained > 0 and (predicted > 0) == bool(prediction)
        assert_counts_match(counts, expected)


@pytest.mark.slow  # as the one above
async def test_specpipe_sampling_with_penalties_keeps_the_targets_penalized_distribution(tmp_path):
    """Tokens 2 and 3 with the presence, frequency and repetition penalties: each SpecPipe
    step decides from the root's row adjusted after the committed text, as AR's does."""
    from tests.test_logit_rules import _joint, _penalized_next_probs

    kw = dict(vocab_size=VOCAB, layers=2, hidden=32, eos_token_id=None, init_std=0.3)
    path = make_tiny_model(tmp_path / "t", "llama", seed=11, **kw)
    decoder = load_decoder(path)
    target = LoadedModel("t", path, decoder.spec, decoder, None, _fingerprint="six-tokens")
    draft = load_decoder(make_tiny_model(tmp_path / "d", "llama", seed=12, **kw))
    penalties = dict(temperature=1.0, max_tokens=3, presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.5)
    expected = _joint(_penalized_next_probs, target.decoder, SamplingParams(**penalties))
    free = _joint(_penalized_next_probs, target.decoder, SamplingParams(temperature=1.0, max_tokens=3))
    assert (expected - free).abs().sum() > 0.2  # the penalties matter
    async with LocalPipeline(target, 2) as pipeline:
        def sample_all():
            counts, hits = torch.zeros(VOCAB, VOCAB, dtype=torch.float64), 0
            for seed in range(1200):
                out, _, _, pipe = specpipe_generate(pipeline.staged.decoder, draft, SMALL_PROMPT,
                                                    SamplingParams(**penalties, seed=seed), TreeShape(2, 2))
                counts[out[1], out[2]] += 1
                hits += pipe.hits
            return counts, hits

        counts, hits = await asyncio.to_thread(sample_all)
        assert hits > 0
        assert_counts_match(counts, expected)


def test_a_level_is_the_likeliest_paths_or_every_nodes_likeliest_child_first():
    # (path probability, frontier row, token), top-2 per row, likeliest first: row 0 is a likely
    # node with two likely children, rows 1 and 2 unlikely ones.
    candidates = [(0.5, 0, 10), (0.3, 0, 11), (0.06, 1, 20), (0.01, 1, 21), (0.05, 2, 30), (0.02, 2, 31)]
    assert spread_level(candidates, 2, 3, "likeliest") == [(0.5, 0, 10), (0.3, 0, 11), (0.06, 1, 20)]
    assert spread_level(candidates, 2, 3, "every-node") == [(0.5, 0, 10), (0.06, 1, 20), (0.05, 2, 30)]
    # A level narrower than the frontier: every-node keeps the likeliest rows' first children.
    assert spread_level(candidates, 2, 2, "every-node") == [(0.5, 0, 10), (0.06, 1, 20)]
    assert spread_level(candidates, 2, 8, "likeliest") == sorted(candidates, reverse=True)
    with pytest.raises(ValueError, match=r"^spread must be one of likeliest, every-node, got 'wide'$"):
        TreeShape(4, 2, "wide")
