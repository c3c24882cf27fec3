"""A request's Predicted Output grafted onto SpecPipe's tree (pipeline/predicted.py): the
chain merged with the draft's nodes and hung below them, bounded, adapting how far it reaches
as the round loop does; the draft reading a chain's nodes with its next level (exactly the
draft's causal logits); exact output through 2 and 4 stages in far fewer forwards, with a
prediction that holds, one edited and one unrelated."""

import asyncio
from dataclasses import replace

import pytest
import torch

from specctl.engine.kv_cache import KVPool
from specctl.engine.loader import load_model
from specctl.pipeline.live_tree import CacheMirror, SpecTree
from specctl.pipeline.local import LocalPipeline
from specctl.pipeline.predicted import PredictedChains
from specctl.pipeline.specpipe import SpecPipeRun, specpipe_generate
from specctl.pipeline.token_source import (DraftLevels, TreeShape, max_tree_nodes, predicted_chain_nodes,
                                           unread_ancestors)
from specctl.spec.decode import DecodeSession
from specctl.spec.prediction import PREDICTED_DEPTH, PREDICTION_NODES
from specctl.spec.rounds import generate
from specctl.spec.params import SamplingParams
from tests.conftest import wait_until

SEQ = [1, 2, 3, 4, 9]  # the committed text; its last token is the tree's root
PREDICTION = [1, 2, 3, 4, 9, 5, 7, 8, 0, 6]


def _tree_with_a_level():
    tree = SpecTree()
    root = tree.add(9, None, 4)
    a, b = tree.add(5, root, 5, 0.6), tree.add(6, root, 5, 0.3)
    return tree, root, a, b


def test_a_chain_merges_with_the_drafts_nodes_and_hangs_the_rest_below_them():
    tree, root, a, b = _tree_with_a_level()
    chains = PredictedChains.of(PREDICTION, budget=16, prompt_len=3, max_tokens=64)
    levels = [[a, b]]
    added = chains.graft(tree, SEQ, [root], levels)
    # 5 is the draft's node a: the chain goes on under it with 7, 8, 0, 6 (one level each past the draft's)
    assert [tree.nodes[n].token for n in added] == [7, 8, 0, 6] and levels == [[a, b], *([n] for n in added)]
    assert [tree.nodes[n].parent for n in added] == [a, *added[:-1]] and [tree.nodes[n].pos for n in added] == [6, 7, 8, 9]
    assert sorted(chains.grafted) == sorted([a, *added]) and chains.sent == 4
    # From the chain's end the prediction has nothing more; from a node off it, none either.
    assert chains.graft(tree, SEQ, [added[-1]], [[]]) == [] and chains.graft(tree, SEQ, [b], [[]]) == []


def test_the_chains_cached_at_once_are_bounded_and_none_without_room_or_a_prediction():
    tree, root, a, b = _tree_with_a_level()
    chains = PredictedChains.of(PREDICTION, budget=3, prompt_len=3, max_tokens=64)
    levels = [[a, b]]
    added = chains.graft(tree, SEQ, [root], levels)  # a (merged) and two more: the budget's 3
    assert [tree.nodes[n].token for n in added] == [7, 8] and len(chains.grafted) == 3
    assert chains.graft(tree, SEQ, [added[-1]], [[]]) == []  # no room left while they are cached
    tree.reroot(b)  # the chain pruned away: room again
    chains.forget(tree)
    assert chains.grafted == {}
    assert PredictedChains.of((), 16, 3, 64) is None and PredictedChains.of(PREDICTION, 0, 3, 64) is None


def test_the_last_chains_end_is_continued_first_then_the_drafts_likeliest_node():
    tree = SpecTree()
    root = tree.add(9, None, 4, 0.5)
    chains = PredictedChains.of([9, 5, 7, 9, 5, 6, 2], budget=16, prompt_len=5, max_tokens=64)
    chains.lookup.depth = 1
    first = chains.graft(tree, SEQ, [root], [[]])[0]  # 5 under the root (one token: depth 1)
    likely = tree.add(5, root, 5, 0.99)  # a likelier node of the draft's with the same text
    assert tree.nodes[first].token == 5 and tree.nodes[first].score == 0.5
    # both continue the prediction; the chain's own end is taken first
    assert tree.nodes[chains.graft(tree, SEQ, [likely, first], [[]])[0]].parent == first


def test_a_decision_counts_the_chains_tokens_and_adapts_how_far_the_next_reaches():
    tree, root, a, b = _tree_with_a_level()
    chains = PredictedChains.of(PREDICTION, budget=64, prompt_len=3, max_tokens=64)
    chains.lookup.depth = 5  # the chain a..6 is a full-depth one (5 tokens)
    levels = [[a, b]]
    c, d, e, f = chains.graft(tree, SEQ, [root], levels)
    assert chains.chain_ends([b, c, f]) == [f]  # the next forward continues the chain alone from there
    for parent, child in ((root, a), (a, c), (c, d), (d, e), (e, f)):
        chains.decided([child] + ([b] if parent == root else []), child)
    assert (chains.accepted, chains.rejected) == (5, 0) and chains.lookup.depth == 11  # doubled: 2 * 5 + 1
    chains.decided([b], b)  # a draft node alone: nothing of a chain's
    assert (chains.accepted, chains.rejected, chains.lookup.depth) == (5, 0, 11)

    tree, root, a, b = _tree_with_a_level()
    chains = PredictedChains.of(PREDICTION, budget=64, prompt_len=3, max_tokens=64)
    c, *_ = chains.graft(tree, SEQ, [root], [[a, b]])
    chains.decided([a, b], a)
    chains.decided([c], None)  # 7 rejected at index 1: it and the 3 after it
    assert (chains.accepted, chains.rejected, chains.lookup.depth) == (1, 4, PREDICTED_DEPTH)


def test_a_sessions_kv_holds_a_full_chain_per_stage_with_a_prediction():
    shape = TreeShape(4, 2)
    assert predicted_chain_nodes(4) == 4 * PREDICTION_NODES
    assert max_tree_nodes(4, shape, predicted=True) == max_tree_nodes(4, shape) + 4 * PREDICTION_NODES


def test_the_draft_reads_a_chains_unread_nodes_before_the_frontier():
    tree, root, a, b = _tree_with_a_level()
    mirror = CacheMirror(prefix=4, order=[root, a, b])
    c = tree.add(7, a, 6)
    d = tree.add(8, c, 7)
    e = tree.add(0, d, 8)
    assert unread_ancestors(tree, mirror, [e]) == [c, d]
    assert unread_ancestors(tree, mirror, [a, b]) == []  # a tree grown level by level: nothing
    assert unread_ancestors(tree, CacheMirror(prefix=4), [d]) == [root, a, c]


@pytest.fixture(scope="module")
def models(tiny_dir):
    return load_model("t", tiny_dir["llama"], "fp32"), load_model("d", tiny_dir["llama"], "fp32", num_layers=2)


def test_a_level_under_a_chain_is_the_drafts_own_next_token_after_its_text(models):
    """The draft reads a grafted chain with its next level (mask over the chain's ancestors,
    their positions): the level under the chain's end is the argmax of the draft's causal
    logits over the committed text and the path."""
    _, draft = models
    prefix, root_token = [5, 9, 13, 2], 17
    levels = DraftLevels(draft.decoder, TreeShape(1, 1), prefix, 64, KVPool(None))
    tree = SpecTree()
    root = tree.add(root_token, None, len(prefix))
    (first,) = levels.next_level(tree, [root])
    chain, at = [], first
    for token in (3, 30, 7):
        at = tree.add(token, at, tree.nodes[at].pos + 1)
        chain.append(at)
    levels.graft(tree, chain)
    (under,) = levels.next_level(tree, [chain[-1]])
    text = prefix + [root_token] + tree.path(chain[-1])
    cache = draft.decoder.new_cache(64)
    logits = draft.decoder(torch.tensor(text), torch.arange(len(text)), cache, logits_at=torch.tensor([len(text) - 1]))
    assert tree.nodes[under].token == int(logits[0].argmax()) and tree.nodes[under].parent == chain[-1]
    assert levels.mirror.order == [root, first, *chain]  # each node read once, parents first
    levels.close()
    cache.release()


@pytest.mark.parametrize("stages", [2, 4])
async def test_specpipe_with_a_prediction_is_exactly_the_target_in_far_fewer_forwards(models, stages):
    target, draft = models
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    prompt = [7, 8, 9, 10, 7, 8, 9]
    alone = generate(target.decoder, prompt, params)[0]
    edited = tuple(alone[:30]) + (3, 4) + tuple(alone[35:])  # an edit in the middle: a miss, then the rest
    # tokens the answer never has: a chance match of the draft's path may propose some, none is accepted
    unrelated = tuple(t for t in range(target.spec.vocab_size) if t not in alone and t not in prompt)[:60]
    async with LocalPipeline(target, stages) as pipeline:
        def run(prediction):
            return specpipe_generate(pipeline.staged.decoder, draft.decoder, prompt,
                                     replace(params, prediction=prediction), TreeShape(3, 2))
        _, _, _, plain = await asyncio.to_thread(run, ())
        for prediction in (tuple(alone), edited, unrelated):
            tokens, stats, reason, pipe = await asyncio.to_thread(run, prediction)
            assert tokens == alone and reason == "length", prediction[:4]
            assert pipe.steps == stats.rounds + 1 == 80  # one decision a token, as without
            assert stats.prediction_accepted == pipe.predicted_accepted
            if prediction is unrelated:
                assert pipe.predicted_accepted == 0
            else:  # most tokens decided by chains: a fraction of the forwards
                assert pipe.predicted_accepted >= (75 if prediction == tuple(alone) else 60)
                assert pipe.levels_sent * 3 < plain.levels_sent
        await wait_until(lambda: all(s.pool.sessions == 0 for s in pipeline.servers), what="stage KV freed")



async def test_while_the_prediction_holds_the_forwards_are_chains_alone_and_the_draft_catches_up_after(models):
    """A prediction that holds for 40 tokens, then none: the draft drafts a level with a chain's
    first forward, none with the forwards that continue it, and when the prediction runs out it
    reads the text it missed in one forward and drafts again; exact."""
    target, draft = models
    prompt = [7, 8, 9, 10, 7, 8, 9]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    alone = generate(target.decoder, prompt, params)[0]
    params = replace(params, prediction=tuple(alone[:40]))
    shape = TreeShape(2, 2)
    async with LocalPipeline(target, 3) as pipeline:
        session = DecodeSession(pipeline.staged.decoder, prompt, params, max_nodes=max_tree_nodes(3, shape, True))
        levels = DraftLevels.for_session(draft.decoder, shape, session)
        run = SpecPipeRun(pipeline.staged.decoder, session, levels, None, shape.refill_depth(3), predicted_chain_nodes(3))
        drafted = []  # (tokens decided, the draft's KV length) at each level it drafts
        original = levels.next_level

        def next_level(tree, frontier):
            drafted.append((len(session.seq) - session.prompt_len, levels.cache.length))
            return original(tree, frontier)
        levels.next_level = next_level
        await asyncio.to_thread(run.run)
        assert session.output == alone and run.stats.predicted_accepted >= 38
        holding = [at for at, _ in drafted if 2 <= at < 40]
        # while the chains held, the draft drafted only where one reached the prediction's end;
        # from then on, a level a forward again
        assert len(holding) <= 2 and len(drafted) - len(holding) > 40
        # it read a chain's text it had missed in one forward (its KV grew by more than a level)
        assert max(b - a for (_, a), (_, b) in zip(drafted, drafted[1:])) > 10
        session.close()
        levels.close()
        await wait_until(lambda: all(s.pool.sessions == 0 for s in pipeline.servers), what="stage KV freed")
