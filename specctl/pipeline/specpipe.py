"""SpecPipe (§3.3): keep a pipelined target busy with a speculative token tree fed one
level per pipeline step.

Stage 1 drives a session: each time a level's output comes back from the last stage it
verifies the current root (the target's next token after it, argmax or the tree-sampling
rule at one node) against the root's children. A hit re-roots the tree to that child and
prunes every stage's KV to its subtree; a miss flushes the tree and refills the pipeline
from the verified token, sent with the draft's first D levels under it in one forward
(``TreeShape.refill``, stages - 1 by default): a lone token's output decides one token after
the n steps a miss costs, the refill's decides the tokens through its levels while they hit
(the next root's row is in the same output). Meanwhile the draft grows the tree by one fixed-width level
(its top-k children per node, the w likeliest paths overall) whenever a pipeline slot
frees, so up to n levels are in flight through n stages. The first tree's root is the
prompt's last token and the prefill is its level: the draft's levels follow the prefill
into the pipeline, so it is full when the first token comes out.

Every stage applies the levels and the prunings in the order stage 1 sent them, so one
mirror of the cache (``CacheMirror``) describes all of them: stage 1 computes each level's
mask and each pruning's kept positions once. A level that a verification leaves with no
live node (all of a flushed tree's, a level wholly pruned) is declared dead on the control
path (StageDrop), which overtakes the levels queued at each stage: a stage that has not
run it yet passes it on without computing it. So are the pruned rows of a level still in
flight that keeps live ones: the stages that have not run it yet compute only the live
rows. The levels come from a token source (``pipeline/token_source.py``)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from specctl.engine.kv_cache import KVPool
from specctl.engine.model import Decoder
from specctl.net.protocol import StageForward, Tensor
from specctl.pipeline.decoder import PipelineDecoder, wait_output
from specctl.pipeline.in_flight import SentLevel, pruned_in_flight
from specctl.pipeline.live_tree import CacheMirror, SpecTree
from specctl.pipeline.pipe_stats import PipeStats
from specctl.pipeline.predicted import PredictedChains
from specctl.pipeline.token_source import DraftLevels, LevelSource, TreeShape, max_tree_nodes, predicted_chain_nodes
from specctl.runtime.emulation import sleep_rest
from specctl.spec.decode import DecodeSession
from specctl.spec.rounds import Emit
from specctl.spec.params import SamplingParams
from specctl.spec.sampling import probs_from_logits
from specctl.spec.stats import GenerationStats, RoundResult
from specctl.spec.verify import accept_at_node


@dataclass(slots=True)
class SpecPipeRun:
    """One session driven through the pipeline (on a thread that may block on it)."""
    target: PipelineDecoder
    session: DecodeSession
    draft: LevelSource
    emit: Emit | None = None
    refill: int = 0  # levels drafted under the verified token after a miss, sent with it (TreeShape.refill)
    # Nodes of the request's predicted chains the session may keep cached (its KV sized for
    # them: token_source.max_tree_nodes(predicted=True)); 0: the prediction is not grafted.
    chain_budget: int = 0
    stats: PipeStats = field(default_factory=PipeStats)
    stop: bool = False  # set from another thread: end after the current step (a cancelled request)
    prefilled: Callable[[], None] | None = None  # called once the prompt is in (its one forward), before its token
    predicted: PredictedChains | None = field(default=None, init=False)  # set by run() from the request

    def run(self) -> None:
        session, cache = self.session, self.session.cache
        begun = time.perf_counter()
        params = session.params
        self.predicted = PredictedChains.of(params.prediction, self.chain_budget, session.prompt_len,
                                            params.max_tokens - session.resumed)
        # Whole rows when the token is not the plain argmax or when the request keeps its
        # log-probabilities; the argmax alone (one int a row) otherwise.
        want = "argmax" if params.greedy and session.rules is None and params.logprobs is None else "logits"
        # The first tree's root is the prompt's last token and the prefill is its level: the
        # draft's levels follow the prefill into the pipeline at once, so the pipeline is
        # already full when the first token comes out (no refill after it).
        last = session.prompt_len - 1
        tree, mirror = SpecTree(), CacheMirror(last)
        root = tree.add(session.seq[-1], None, last)
        self.draft.start(session.seq[-1], last)
        prompt = torch.tensor(session.seq[: session.prompt_len])
        in_flight = deque([SentLevel(self._forward(prompt, torch.arange(len(prompt)), None, [len(prompt) - 1], want,
                                               begun, tag=0), [root], 0, 0)])
        mirror.append([root])
        self.stats.levels_sent = 1
        levels: list[list[int]] = [[root]]  # levels sent of the live tree, root's first
        tree_epoch, draft_s, wait_s, first = 0, 0.0, 0.0, True
        while not session.finished and not self.stop:
            # One forward per stage in flight; without a draft (a remote one went away) one
            # root at a time: plain pipeline parallelism, the same tokens.
            while len(in_flight) < (self.target.stages if self.draft.alive else 1):
                started = time.perf_counter()
                new_levels = self._next_levels(tree, levels, root)
                if new_levels is None:  # the draft just went away: verify what is in flight, then go on without it
                    break
                draft_s += time.perf_counter() - started
                tag = self.stats.levels_sent
                forward = [node for level in new_levels for node in level]
                in_flight.append(SentLevel(self._send(tree, mirror, forward, want, started, tag), forward, tree_epoch, tag))
                self.stats.stage1_s += time.perf_counter() - started
                levels.extend(new_levels)
                self.stats.levels_sent += 1
            self.stats.draft_lost |= not self.draft.alive
            assert in_flight, "a live tree's levels are always in flight"
            sent = in_flight.popleft()
            started = time.perf_counter()
            output = wait_output(sent.future, self.target.device)
            wait_s += time.perf_counter() - started
            if sent.tree_epoch != tree_epoch or root not in sent.level:
                self.stats.stale_outputs += sent.tree_epoch != tree_epoch
                self.stats.bubbles += sent.tree_epoch == tree_epoch
                continue
            if output.numel() == 0:
                raise RuntimeError("a pipeline stage dropped a level that was not declared dead")
            decided = 0
            # A refill's output holds the root's row and its subtree's: the decisions chain
            # through it while they hit (the next root's row is in the same output).
            while root in sent.level and not session.finished:
                children = [c for c in (levels[1] if len(levels) > 1 else []) if tree.nodes[c].parent == root]
                row = output[sent.level.index(root)]
                index, token = self._decide(row, [tree.nodes[c].token for c in children])
                committed = session.commit([token], *((None, None) if row.dim() == 0 else (row[None], [0])))
                self.stats.steps += 1
                self.stats.refill_tokens += decided > 0
                decided += 1
                new_root = None if index is None else children[index]
                if children:
                    self.stats.hits += new_root is not None
                    self.stats.flushes += new_root is None
                if self.predicted is not None:
                    self.predicted.decided(children, new_root)
                    self._count_predicted(session)  # as each step goes: a cancelled request's reply has them
                result = None
                if first:  # the prompt's next token: reported as the prefill's, as the round loop does
                    session.stats.prefill_s, first = time.perf_counter() - begun, False
                    session.prefilled = session.prompt_len
                    if self.prefilled is not None:
                        self.prefilled()
                else:
                    result = RoundResult(1 if children else 0, len(children), int(new_root is not None),
                                         len(committed), draft_s, wait_s)
                    session.stats.record(result)
                draft_s = wait_s = 0.0
                if self.emit:
                    self.emit(committed, result)
                cache.gather(mirror.reroot(tree, root, new_root))  # every stage prunes, in order
                if self.draft.alive:
                    self.draft.reroot(tree, root, new_root, token, len(session.seq) - 1)
                if new_root is None:  # flush: refill from the verified token
                    tree_epoch += 1
                    tree, levels = SpecTree(), []
                    root = tree.add(token, None, len(session.seq) - 1)
                    self._forget(None)
                    break
                tree.reroot(new_root)
                self._forget(tree)
                root = new_root
                levels = [[n for n in level if n in tree.nodes] for level in levels[1:]]
                if [] in levels:  # a level wholly in pruned branches: the tree grows again from above it
                    levels = levels[: levels.index([])]
            self._declare_dead(in_flight, tree, tree_epoch)
        if self.predicted is not None:
            self._count_predicted(session)

    def _count_predicted(self, session: DecodeSession) -> None:
        """The request's prediction counts, as the round loop's (spec.stats), and the run's."""
        session.stats.prediction_accepted = self.stats.predicted_accepted = self.predicted.accepted
        session.stats.prediction_rejected = self.stats.predicted_rejected = self.predicted.rejected
        self.stats.predicted = self.predicted.sent

    def _forget(self, tree: SpecTree | None) -> None:
        if self.predicted is not None:
            self.predicted.forget(tree)

    def _next_levels(self, tree: SpecTree, levels: list[list[int]], root: int) -> list[list[int]] | None:
        """The next forward's levels: one more under the frontier; after a flush (no level
        sent yet) the verified token with up to ``refill`` levels drafted under it. Both carry
        the request's predicted chain where it continues the frontier (pipeline.predicted); a
        chain's end is continued by a chain alone. None: the draft went away before it gave a level."""
        if levels:
            new_levels = []
            if self.predicted is not None and (ends := self.predicted.chain_ends(levels[-1])):
                self._graft(tree, ends, new_levels)  # a chain goes on alone from its end
                if new_levels:
                    return new_levels
            level = self.draft.next_level(tree, levels[-1])
            if level is None:
                return None
            new_levels = [level]
            self._graft(tree, levels[-1], new_levels)
            return new_levels
        refill = [[root]]
        if not self.draft.alive and self.draft.revive(self.session.seq):  # the tree is the verified token alone
            self.stats.draft_reopened += 1
        for _ in range(self.refill if self.draft.alive else 0):
            level = self.draft.next_level(tree, refill[-1])
            if level is None:  # gone meanwhile: the token goes with what was drafted (plain PP until it is back)
                break
            refill.append(level)
        under = refill[1:]
        self._graft(tree, [root], under)  # without a draft too: the prediction needs none
        self.stats.refills += len(under) > 0
        return [[root], *under]

    def _graft(self, tree: SpecTree, frontier: list[int], new_levels: list[list[int]]) -> None:
        if self.predicted is not None:
            added = self.predicted.graft(tree, self.session.seq, frontier, new_levels)
            if added and self.draft.alive:
                self.draft.graft(tree, added)

    def _declare_dead(self, in_flight: deque[SentLevel], tree: SpecTree, tree_epoch: int) -> None:
        """Tell the other stages (control path) what the verification just pruned from the
        levels in flight (pipeline.in_flight)."""
        tags, rows = pruned_in_flight(in_flight, tree, tree_epoch, self.stats)
        if tags:
            self.session.cache.drop(tags, rows)

    def _send(self, tree: SpecTree, mirror: CacheMirror, level: list[int], want: str, started: float, tag: int):
        tail = mirror.level_mask(tree, level)
        mask = torch.cat([torch.ones(len(level), mirror.prefix, dtype=torch.bool), tail], 1)
        tokens = torch.tensor([tree.nodes[i].token for i in level])
        positions = torch.tensor([tree.nodes[i].pos for i in level])
        future = self._forward(tokens, positions, (mask, tail), list(range(len(level))), want, started, tag)
        mirror.append(level)
        return future

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, masks: tuple[torch.Tensor, torch.Tensor] | None,
                 logits_at: list[int], want: str, started: float, tag: int):
        """Stage 1's layers over one forward of this session (``masks``: its full mask and the
        tail the other stages rebuild it from; None = causal), then down the chain."""
        cache = self.session.cache
        hidden = self.target.local.forward_ragged(tokens, positions, [(0, len(tokens))], [cache],
                                                  [None if masks is None else masks[0]])
        # Emulated device time: drafting the level (since ``started``) and stage 1's layers in one step.
        sleep_rest(started, self.target.delay_s)
        frames = (Tensor.from_torch(positions), None if masks is None else Tensor.from_torch(masks[1]),
                  Tensor.from_torch(hidden))
        n, sid = len(tokens), cache.sid
        return self.target.client.submit(cache.epoch, lambda fid: StageForward(
            fid, [sid], [n], frames[0], [frames[1]], [logits_at], frames[2], want, [tag]))

    def _decide(self, row: torch.Tensor, children: list[int]) -> tuple[int | None, int]:
        """The target's token after the root, and which child it is (None: none of them). The
        root's row is the next token's after the committed text, as AR's step is: the request's
        logit rules (penalties, grammar, thinking budget ...) adjust it as they adjust AR's."""
        session = self.session
        if row.dim() == 0:  # an argmax sent back
            token = int(row)
            return (children.index(token) if token in children else None), token
        scored = session.scored_next(row[None].float())[0]
        if session.params.greedy:
            token = int(scored.argmax())
            return (children.index(token) if token in children else None), token
        return accept_at_node(children, probs_from_logits(scored, session.params), session.generator)


def specpipe_generate(target: PipelineDecoder, draft: Decoder, prompt: list[int], params: SamplingParams,
                      shape: TreeShape = TreeShape(), *, eos_token_ids: tuple[int, ...] = (),
                      max_context: int | None = None, pool: KVPool | None = None, draft_pool: KVPool | None = None,
                      on_tokens: Emit | None = None, tokenizer: Any = None, resumed: tuple[int, ...] = (),
                      ) -> tuple[list[int], GenerationStats, str | None, PipeStats]:
    """Run one session to the end with SpecPipe: (tokens, stats, finish_reason, pipeline stats);
    ``tokenizer``: the target's, which a grammar needs; ``resumed``: ``DecodeSession``'s."""
    started = time.perf_counter()
    predicted = bool(params.prediction)
    session = DecodeSession(target, prompt, params, eos_token_ids, max_context, pool,
                            max_tree_nodes(target.stages, shape, predicted), tokenizer=tokenizer, resumed=resumed)
    source = None
    try:
        source = DraftLevels.for_session(draft, shape, session, draft_pool)
        run = SpecPipeRun(target, session, source, on_tokens, shape.refill_depth(target.stages),
                          predicted_chain_nodes(target.stages) if predicted else 0)
        run.run()
    finally:
        session.stats.wall_s = time.perf_counter() - started
        session.close()
        if source is not None:
            source.close()
    return session.output, session.stats, session.finish_reason, run.stats
