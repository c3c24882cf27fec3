"""Several micro-batches in flight through the stages (the batch mode, SpecPipe-DB): the
verification of the sessions due together runs stage 1's layers on the compute thread,
goes down the chain, and frees the thread while the other stages work, so the next group
of sessions can enter the pipeline at once. Each session accepts when its rows return.

A lane wrapper, like the emulation's SlowedLane: the round loop is unchanged."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import torch

from specctl.spec.decode import DecodeSession
from specctl.spec.drafters import Proposal


def send_verifications(items: list[tuple[DecodeSession, Proposal]]) -> list:
    """On the compute thread: one micro-batch for every session that fits; per item
    (future, first row, rows, the proposal with its tensors built) or its exception."""
    results: list = [None] * len(items)
    ready = []
    built: dict[int, Proposal] = {}
    for i, (session, proposal) in enumerate(items):
        try:
            built[i] = proposal.built()
            ready.append((i, session, session.verify_inputs(built[i])))
        except Exception as exc:  # noqa: BLE001 - handed back to that session only
            results[i] = exc
    if not ready:
        return results
    target = ready[0][1].target
    try:
        future = target.send_many([x[0] for _, _, x in ready], [x[1] for _, _, x in ready],
                                  [s.cache for _, s, _ in ready], [x[2] for _, _, x in ready],
                                  [torch.arange(x[0].shape[0]) for _, _, x in ready])
    except Exception as exc:  # noqa: BLE001 - the whole micro-batch failed (the chain is down)
        for i, _, _ in ready:
            results[i] = exc
        return results
    start = 0
    for i, _, inputs in ready:
        results[i] = (future, start, inputs[0].shape[0], built[i])
        start += inputs[0].shape[0]
    return results


def _accept_rows(session, proposal, frame, start: int, rows: int):
    return session.accept(proposal, frame.to_torch()[start : start + rows].float())


class MicroBatchLane:
    """A lane for a pipelined target: "verify" batches go down the chain without holding the
    compute thread; everything else runs on the wrapped lane as usual."""

    def __init__(self, lane) -> None:
        self.lane = lane

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.lane.run(fn, *args)

    async def run_batched(self, key: str, fn: Callable[[list], list], item: Any) -> Any:
        if key != "verify":
            return await self.lane.run_batched(key, fn, item)
        sent = await self.lane.run_batched("verify-send", send_verifications, item)
        if isinstance(sent, BaseException):
            raise sent
        future, start, rows, proposal = sent
        frame = await asyncio.wrap_future(future)
        session = item[0]
        # the vocabulary-wide conversion on the compute thread too (DESIGN: only it runs torch's
        # parallel ops; one here would keep an OpenMP pool alive that slows every later step)
        return await self.lane.run(_accept_rows, session, proposal, frame, start, rows)

    def submit_nowait(self, fn: Callable[..., Any], *args: Any) -> None:
        self.lane.submit_nowait(fn, *args)
