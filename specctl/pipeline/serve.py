"""SpecPipe sessions in a target instance (stage 1 of ``verify --stage 1/n --specpipe-draft M``,
or ``--draft H:P --specpipe`` with the levels from a draft server): each session's driver
runs on the device's compute lane, one session at a time (SpecPipe's single-request mode:
the pipeline is kept full by one session's tree levels).

A request's Predicted Output is grafted onto the session's tree (pipeline/predicted.py): its
predicted stretches go through the stages as chains, where SpecPipe's levels commit a token or
so per stage step; its KV holds the chains in flight (``max_nodes(stages, predicted=True)``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specctl.engine.model import Decoder
from specctl.pipeline.pipe_stats import PipeStats
from specctl.pipeline.specpipe import SpecPipeRun
from specctl.pipeline.token_source import DraftLevels, LevelSource, TreeShape, max_tree_nodes, predicted_chain_nodes
from specctl.spec.decode import DecodeSession
from specctl.spec.logprobs import TokenLogprob, emitted_logprobs
from specctl.spec.stats import RoundResult

# (tokens, their round's result, their log-probability entries as taken when they were emitted)
ScoredEmit = Callable[[list[int], RoundResult | None, list[TokenLogprob]], None]


@dataclass(frozen=True, slots=True)
class SpecPipeDraft:
    shape: TreeShape
    name: str  # the draft model's name or the draft server's address, for logs
    open_levels: Callable[[DecodeSession], LevelSource]  # a session's level source (on the compute thread)
    totals: PipeStats = field(default_factory=PipeStats)  # every session's steps, hits, flushes

    @classmethod
    def local(cls, draft: Decoder, shape: TreeShape, name: str) -> "SpecPipeDraft":
        """Levels from ``draft`` in this process."""
        return cls(shape, name, lambda session: DraftLevels.for_session(draft, shape, session))

    @classmethod
    def remote(cls, client, loop: asyncio.AbstractEventLoop, shape: TreeShape, name: str) -> "SpecPipeDraft":
        """Levels from the draft server behind ``client`` (a DraftClient on ``loop``)."""
        from specctl.pipeline.remote_levels import RemoteLevels

        return cls(shape, name, lambda session: RemoteLevels(client, loop, shape, session))

    def max_nodes(self, stages: int, predicted: bool = False) -> int:
        """The most tree nodes one session keeps cached (with a request's prediction, its
        chains too): its KV is sized for them."""
        return max_tree_nodes(stages, self.shape, predicted)

    def snapshot(self) -> dict:
        t = self.totals
        return {"specpipe_steps": t.steps, "specpipe_hits": t.hits, "specpipe_flushes": t.flushes,
                "specpipe_hit_rate": round(t.hit_rate, 4), "specpipe_width": self.shape.width,
                "specpipe_draft_lost": t.draft_lost, "specpipe_draft_reopened": t.draft_reopened,
                "specpipe_levels_dropped": t.levels_dropped,
                "specpipe_refills": t.refills, "specpipe_refill_tokens": t.refill_tokens,
                "specpipe_predicted": t.predicted}


async def serve_specpipe(session: DecodeSession, spec: SpecPipeDraft, lane, emit: ScoredEmit,
                         prefilled: Callable[[], None] | None = None) -> None:
    """Run ``session`` to the end with SpecPipe; its KV (every stage's) and the draft's are
    freed however it ends. A cancelled request stops after the step in progress. ``emit`` is
    called on the event loop with each token's log-probability entries taken on the compute
    thread as it emitted them: the driver has decided more tokens by the time the loop runs.
    ``prefilled``: called on the event loop once the prompt is in (one forward through the
    stages: one call), before the first token's ``emit``."""
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    run, cancelled = None, False

    def drive() -> None:
        nonlocal run
        if cancelled:  # cancelled while queued
            return
        stages = session.target.stages
        run = SpecPipeRun(session.target, session, spec.open_levels(session),
                          lambda tokens, result: loop.call_soon_threadsafe(emit, tokens, result,
                                                                           emitted_logprobs(session, len(tokens))),
                          spec.shape.refill_depth(stages),
                          predicted_chain_nodes(stages) if session.params.prediction else 0)
        run.stop = cancelled
        if prefilled is not None:
            run.prefilled = lambda: loop.call_soon_threadsafe(prefilled)  # in order: before the first emit
        try:
            run.run()
        finally:  # before the reply ends: a client reading the stats next sees this session in them
            spec.totals.add(run.stats)

    def free() -> None:
        session.close()
        if run is not None:
            run.draft.close()

    job = asyncio.ensure_future(lane.run(drive))
    try:
        await asyncio.shield(job)
    except asyncio.CancelledError:
        cancelled = True
        if run is not None:
            run.stop = True
        raise
    finally:
        session.stats.wall_s = time.perf_counter() - started
        lane.submit_nowait(free)  # after the driver: the lane runs jobs in order

