"""SpecPipe's levels from a draft server (``verify --stage 1/n --draft H:P --specpipe``):
stage 1's driver, on its compute thread, asks the draft server for each level over the
target's draft link and mirrors the tree the server grows. When the draft goes away (no
reply, a refusal, a tree out of step) the source is dead from then on and stage 1 goes on
as plain pipeline parallelism: slower, the same tokens."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Coroutine

from specctl.pipeline.live_tree import SpecTree
from specctl.pipeline.token_source import TreeShape, level_capacity
from specctl.spec.decode import DecodeSession
from specctl.verify.draft_client import DraftClient, Handle

log = logging.getLogger("specctl.pipeline")


class RemoteLevels:
    def __init__(self, client: DraftClient, loop: asyncio.AbstractEventLoop, shape: TreeShape,
                 session: DecodeSession, timeout_s: float = 30.0) -> None:
        self.client, self.loop, self.timeout_s = client, loop, timeout_s
        self.lost: str | None = None  # why the draft went away, once it did
        capacity = level_capacity(session.prompt_len, session.params.max_tokens, session.target.stages, shape,
                                  bool(session.params.prediction))
        self.handle: Handle | None = self._call(client.open_levels(session.seq[: session.prompt_len - 1], shape.width,
                                                                   shape.topk, capacity, shape.spread,
                                                                   session.params))
        if self.handle is None:
            self._lose(f"no level session ({client.last_error or 'the draft server refused or did not answer'})")

    @property
    def alive(self) -> bool:
        return self.lost is None

    def start(self, token: int, position: int) -> None:
        self._post(-1, -1, token, position)

    def next_level(self, tree: SpecTree, frontier: list[int]) -> list[int] | None:
        if not self.alive:
            return None
        level = self._call(self.client.next_level(self.handle, frontier))
        if level is None:
            self._lose(f"no level from the draft server ({self.client.last_error or 'no answer or a refusal'})")
            return None
        sizes = {len(level.nodes), len(level.tokens), len(level.parents), len(level.scores)}
        if len(sizes) != 1 or not level.nodes or any(parent not in frontier for parent in level.parents):
            self._lose("the draft server's level does not extend the frontier")
            return None
        ids = [tree.add(token, parent, tree.nodes[parent].pos + 1, score)
               for token, parent, score in zip(level.tokens, level.parents, level.scores)]
        if ids != level.nodes:  # never sent: the unsent nodes are pruned with their tree
            self._lose(f"the draft server's tree is out of step (node ids {level.nodes[:4]} != {ids[:4]})")
            return None
        return ids

    def graft(self, tree: SpecTree, nodes: list[int]) -> None:
        """The draft server hangs the same chain (its node ids follow: both trees add alike)."""
        if self.alive:
            self._soon(self.client.graft, self.handle, tree.nodes[nodes[0]].parent, [tree.nodes[n].token for n in nodes])

    def reroot(self, tree: SpecTree, committed: int, new_root: int | None, token: int, position: int) -> None:
        self._post(committed, -1 if new_root is None else new_root, token, position)

    def close(self) -> None:
        if self.handle is not None:
            self._soon(self.client.close, self.handle)
            self.handle = None

    def _post(self, committed: int, new_root: int, token: int, position: int) -> None:
        if self.alive:
            self._soon(self.client.reroot, self.handle, committed, new_root, token, position)

    def _soon(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closing: the connection goes with it
            pass

    def _call(self, coro: Coroutine):
        try:
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s + 5)
        except (concurrent.futures.TimeoutError, RuntimeError, ConnectionError):
            return None

    def _lose(self, why: str) -> None:
        if self.lost is None:
            log.warning("SpecPipe's draft went away (%s): decoding as plain pipeline parallelism", why)
            self.lost = why
