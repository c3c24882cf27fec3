"""SpecPipe's levels from a draft server (``verify --stage 1/n --draft H:P --specpipe``):
stage 1's driver, on its compute thread, asks the draft server for each level over the
target's draft link and mirrors the tree the server grows. When the draft goes away (no
reply, a refusal, a tree out of step) stage 1 goes on as plain pipeline parallelism: slower,
the same tokens. It asks for a level session again at a flush (the tree is the verified
token alone then): a second after a refusal for room (a full draft server, StarSD's
admission), once the link is back after a lost link, never for anything else on that link."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
from collections.abc import Coroutine

from specctl.pipeline.live_tree import SpecTree
from specctl.pipeline.token_source import TreeShape, level_capacity
from specctl.spec.decode import DecodeSession
from specctl.net.protocol import Error
from specctl.verify.draft_client import DraftClient, Handle, Refusal, may_ask_again, refusal

log = logging.getLogger("specctl.pipeline")


class RemoteLevels:
    def __init__(self, client: DraftClient, loop: asyncio.AbstractEventLoop, shape: TreeShape,
                 session: DecodeSession, timeout_s: float = 30.0) -> None:
        self.client, self.loop, self.timeout_s, self.shape, self.session = client, loop, timeout_s, shape, session
        self.lost: str | None = None  # why the draft went away, while it is away
        self._retry: Refusal = (client.epoch, math.inf)  # while away: when to ask again
        self._quiet = False  # the draft is away for want of room (a debug line, not a warning)
        self.handle: Handle | None = None
        self._open(session.seq[: session.prompt_len - 1])

    def _open(self, text: list[int]) -> bool:
        """Open a level session whose text is ``text`` (the tree's root comes with ``start``)."""
        session, shape, epoch = self.session, self.shape, self.client.epoch
        # the text and the tokens still to come: the same capacity however much is output
        capacity = level_capacity(session.prompt_len, session.params.max_tokens, session.target.stages, shape,
                                  bool(session.params.prediction))
        generated = len(text) + 1 - session.prompt_len + session.resumed  # the root counts: it is output
        reply = self._call(self.client.open_levels(text, shape.width, shape.topk, capacity, shape.spread,
                                                   session.params, generated))
        if isinstance(reply, tuple):
            self.handle = reply
            return True
        self._retry = refusal(reply, epoch)
        why = reply.message if isinstance(reply, Error) else (self.client.last_error or "the draft server did not answer")
        self._lose(f"no level session ({why})", quiet=self._retry[1] < math.inf)  # for room: no fault
        return False

    def revive(self, seq: list[int]) -> bool:
        """At a flush (the tree is ``seq``'s last token alone): open a level session again if
        the draft went away and may be back; True when it is."""
        if self.alive or not self.client.connected.is_set():
            return False
        if not may_ask_again(self._retry, self.client.epoch):
            return False
        self.handle, was_quiet = None, self._quiet  # an earlier link's session went with it
        if not self._open(seq[:-1]):
            return False
        log.log(logging.DEBUG if was_quiet else logging.INFO,
                "SpecPipe's draft is back (was: %s): drafting levels again", self.lost)
        self.lost, self._quiet = None, False
        self.start(seq[-1], len(seq) - 1)  # alive again: sent
        return True

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
            self._lose_session(f"no level from the draft server ({self.client.last_error or 'no answer or a refusal'})")
            return None
        sizes = {len(level.nodes), len(level.tokens), len(level.parents), len(level.scores)}
        if len(sizes) != 1 or not level.nodes or any(parent not in frontier for parent in level.parents):
            self._lose_session("the draft server's level does not extend the frontier")
            return None
        ids = [tree.add(token, parent, tree.nodes[parent].pos + 1, score)
               for token, parent, score in zip(level.tokens, level.parents, level.scores)]
        if ids != level.nodes:  # never sent: the unsent nodes are pruned with their tree
            self._lose_session(f"the draft server's tree is out of step (node ids {level.nodes[:4]} != {ids[:4]})")
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

    def _lose_session(self, why: str) -> None:
        """The open level session failed: asked for again once the link is back (a lost link), never on this one."""
        self._retry = (self.handle[0], math.inf)
        self._lose(why)

    def _lose(self, why: str, quiet: bool = False) -> None:
        if self.lost is None:
            log.log(logging.DEBUG if quiet else logging.WARNING,
                    "SpecPipe's draft went away (%s): decoding as plain pipeline parallelism", why)
            self.lost, self._quiet = why, quiet
