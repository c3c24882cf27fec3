"""Stage 1 of a pipeline: a decoder that runs the embedding and its own layers here and
the rest on stages 2..n, behind the same interface as a whole-model ``Decoder``
(``forward``, ``forward_many``, ``new_cache``). So the one round loop, every speculator
and the acceptance rules run unchanged on a pipelined target: a proposal (chain or tree)
goes through the stages as one micro-batch, and the sessions verified together go as one.

The caches it hands out mirror every change to the session's KV (a verification's
pruning, the close) to the other stages, in order with the forwards, so no stage ever
holds KV the verification rejected."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from typing import Callable

import torch

from specctl.engine.kv_cache import KVCache, KVPool
from specctl.engine.model import Decoder, ragged_bounds
from specctl.errors import StageUnavailable, connection_failure
from specctl.net.protocol import (Error, Message, StageClose, StageDrop, StageForward, StageKeep, StageOpen,
                                  StageOutput, Stats, StatsRequest, Tensor)
from specctl.pipeline.link import StageLink
from specctl.pipeline.worker import split_keep
from specctl.runtime.emulation import sleep_rest

log = logging.getLogger("specctl.pipeline")
# A session's forward unanswered this long ends that session only: the heartbeat below, not a
# forward's own time (a long prompt on a slow box), tells whether the chain is hung.
FORWARD_TIMEOUT_S = 600.0
# Every stage answers a StatsRequest on its event loop, beside its compute: a chain whose last
# stage says nothing (no stats, no output) for STAGE_SILENCE_S is hung (a stopped process keeps
# its connections open), however long a forward takes; asked every HEARTBEAT_S.
HEARTBEAT_S = 2.0
STAGE_SILENCE_S = 30.0


class PipelineClient:
    """Stage 1's link to stage 2, kept up in the background; callable from the compute thread."""

    def __init__(self, make_link: Callable[[Callable[[Message], None]], StageLink]) -> None:
        self.make_link = make_link
        self.loop: asyncio.AbstractEventLoop | None = None
        self.link: StageLink | None = None
        self.epoch = 0  # one per chain: sessions of an older chain have no KV on the other stages
        self.connected = asyncio.Event()
        self.last_error: str | None = None
        self.reconnects = 0
        self.stage_stats: dict[str, dict] = {}  # "i/n" -> that stage's latest stats
        self.most_in_flight = 0  # the most micro-batches ever in the chain at once
        self._silent_since: float | None = None  # asked the chain since then, and the last stage said nothing
        self._heard: dict[int, float] = {}  # stage index -> when its stats last came (this chain)
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._fids = itertools.count(1)

    async def run(self, first_connected: asyncio.Future | None = None) -> None:
        """Keep the chain up until cancelled; ``first_connected`` gets the first attempt's outcome."""
        self.loop = asyncio.get_running_loop()
        backoff = 0.2
        while True:
            link = self.make_link(self._on_reply)
            try:
                await link.connect()
            except Exception as exc:  # noqa: BLE001 - retried; the message says which stage is missing
                self.last_error = (f"stage {link.address}: {connection_failure(exc)}" if isinstance(exc, OSError)
                                   else str(exc) or type(exc).__name__)
                if first_connected is not None and not first_connected.done():
                    first_connected.set_result(False)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            self.link, backoff = link, 0.2
            self.epoch += 1
            if self.last_error is not None:
                log.info("pipeline chain from %s is whole again", link.address)
                self.reconnects += 1
            self.last_error = None
            self.connected.set()
            if first_connected is not None and not first_connected.done():
                first_connected.set_result(True)
            heartbeat = asyncio.create_task(self._heartbeat(link))
            try:
                await link.closed.wait()
            finally:
                heartbeat.cancel()
                # The reason first: a session checking the link while it closes below must read
                # why (it once read "not connected yet" in that window).
                self.last_error = link.error or "closed"
                self.connected.clear()
                await link.close()
                self._fail_pending(f"the pipeline chain broke ({link.error or 'closed'})")
            self.last_error = link.error or "closed"
            log.warning("lost the pipeline at %s (%s): its sessions end; reconnecting", link.address, self.last_error)

    def refresh_stats(self) -> list[dict]:
        """The stages' latest stats (loop thread), asking for fresh ones for next time."""
        if self.link is not None and self.connected.is_set():
            self.link.post(StatsRequest())
        return [self.stage_stats[key] for key in sorted(self.stage_stats, key=lambda k: int(k.split("/")[0]))]

    async def _heartbeat(self, link: StageLink) -> None:
        """Ask every stage for its stats each HEARTBEAT_S; give the chain up once its last stage
        has been silent for STAGE_SILENCE_S, naming the first stage that stopped answering."""
        self._silent_since, self._heard = None, {}
        while not link.closed.is_set():
            now = time.monotonic()
            if self._silent_since is None:
                self._silent_since = now
            elif now - self._silent_since > STAGE_SILENCE_S:
                quiet = next(i for i in itertools.count(2) if self._heard.get(i, 0.0) < self._silent_since)
                log.warning("pipeline stage %d has not answered for %g s: dropping the chain", quiet, STAGE_SILENCE_S)
                link.give_up(f"stage {quiet} has not answered for {STAGE_SILENCE_S:g} s: stopped or hung")
                return
            link.post(StatsRequest())
            # forwards whose sessions gave up waiting: their outputs, if they ever come, go nowhere
            self._pending = {fid: future for fid, future in self._pending.items() if not future.cancelled()}
            await asyncio.sleep(HEARTBEAT_S)

    def _on_reply(self, message: Message) -> None:
        if isinstance(message, Stats):
            key = str(message.stats.get("stage"))
            self.stage_stats[key] = message.stats
            index, _, count = key.partition("/")
            if index.isdigit():
                self._heard[int(index)] = time.monotonic()
                if index == count:  # the last stage answered: every link between is alive
                    self._silent_since = None
        elif isinstance(message, StageOutput):
            self._silent_since = None  # outputs come from the last stage
            future = self._pending.pop(message.fid, None)
            if future is not None:
                _settle(future, future.set_result, message.logits)
        elif isinstance(message, Error):
            future = self._pending.pop(message.req, None) if message.req is not None else None
            if future is not None:
                _settle(future, future.set_exception, StageUnavailable(message.message))
            else:
                self.last_error = message.message

    def _fail_pending(self, why: str) -> None:
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(StageUnavailable(f"{why}: the session cannot go on; retry"))

    def _check(self, epoch: int) -> None:
        if not self.connected.is_set():
            raise StageUnavailable(f"the pipeline is down ({self.last_error or 'not connected yet'}); retry later")
        if epoch != self.epoch:
            raise StageUnavailable("the pipeline was rebuilt since this session started (its KV on the other "
                                   "stages is gone); retry")

    def post(self, epoch: int, message: Message) -> None:
        """From the compute thread: one control frame, in order with the forwards."""
        if self.loop is not None and not self.loop.is_closed():  # a cache freed at exit has nobody to tell
            self.loop.call_soon_threadsafe(self._post, epoch, message)

    def _post(self, epoch: int, message: Message) -> None:
        if epoch == self.epoch and self.link is not None:
            self.link.post(message)

    def submit(self, epoch: int, make: Callable[[int], StageForward]) -> concurrent.futures.Future:
        """From any thread but the loop's: send a micro-batch down the chain now; the future
        gets the last stage's output (a Tensor frame). Outputs come back in sending order."""
        self._check(epoch)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.loop.call_soon_threadsafe(self._send_forward, epoch, make, future)
        return future

    def _send_forward(self, epoch: int, make: Callable[[int], StageForward], future) -> None:
        try:
            self._check(epoch)
        except StageUnavailable as exc:
            future.set_exception(exc)
            return
        fid = next(self._fids)
        self._pending[fid] = future
        self.most_in_flight = max(self.most_in_flight, len(self._pending))
        self.link.post(make(fid))


def _settle(future: concurrent.futures.Future, settle: Callable, value) -> None:
    try:
        settle(value)
    except concurrent.futures.InvalidStateError:  # its session gave up waiting (wait_output) just now
        pass


def wait_output(future: concurrent.futures.Future, device: torch.device) -> torch.Tensor:
    """The micro-batch's output, on stage 1's ``device`` (where its sessions' logit rules and
    samplers are, as a whole model's logits would be); past FORWARD_TIMEOUT_S its session ends
    (StageUnavailable), the chain's other sessions going on (a hung chain is the heartbeat's to drop)."""
    try:
        return future.result(FORWARD_TIMEOUT_S).to_torch().to(device)
    except concurrent.futures.TimeoutError:
        future.cancel()  # the heartbeat takes it out of the pending table
        raise StageUnavailable(f"the pipeline did not answer this session's forward within {FORWARD_TIMEOUT_S:g} s "
                               "while its stages answer; retry") from None


class PipelineCache(KVCache):
    """A session's KV on stage 1 whose pruning and release reach every other stage."""

    def __init__(self, decoder: Decoder, capacity: int, pool: KVPool | None, client: PipelineClient, sid: int) -> None:
        s = decoder.spec
        super().__init__(decoder.num_layers, s.num_kv_heads, s.head_dim, capacity, decoder.dtype, decoder.device, pool,
                         planes=s.kv_planes)
        self.client, self.sid, self.epoch = client, sid, client.epoch
        client._check(self.epoch)
        client.post(self.epoch, StageOpen(sid, capacity))

    def truncate(self, length: int) -> None:
        super().truncate(length)
        self.client.post(self.epoch, StageKeep(self.sid, length))

    def gather(self, keep) -> None:
        super().gather(keep)
        prefix, tail = split_keep(keep)
        self.client.post(self.epoch, StageKeep(self.sid, prefix, tail))

    def drop(self, tags: list[int], rows: list[list[int]] | None = None) -> None:
        """Declare rows of this session's forwards ``tags`` dead on every stage (they overtake
        the queue): per tag its dead rows, [] = all of them (also when ``rows`` is None)."""
        self.client.post(self.epoch, StageDrop(self.sid, tags, rows or []))

    def release(self) -> None:
        if not self.released:
            self.client.post(self.epoch, StageClose(self.sid))
        super().release()


class PipelineDecoder:
    """Embedding + layers [0, b) here; layers [b, L) + norm + head on stages 2..n."""

    def __init__(self, local: Decoder, client: PipelineClient, stages: int = 2, delay_s: float = 0.0) -> None:
        if local.lm_head is not None or local.embed_tokens is None:
            raise ValueError("stage 1 of a pipeline embeds and has no LM head")
        self.local, self.client, self.stages = local, client, stages
        self.delay_s = delay_s  # emulated time of stage 1's own step (as --stage-delay-ms on the others)
        self.spec, self.layer_range = local.spec, local.layer_range
        self._sids = itertools.count(1)

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    def new_cache(self, capacity: int, pool: KVPool | None = None) -> PipelineCache:
        return PipelineCache(self.local, capacity, pool, self.client, next(self._sids))

    def __call__(self, inputs: torch.Tensor, positions: torch.Tensor, cache: PipelineCache,
                 mask: torch.Tensor | None = None, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        at = logits_at if logits_at is not None else torch.arange(inputs.shape[0])
        return self.forward_many([inputs], [positions], [cache], [mask], [at])[0]

    forward = __call__

    def forward_many(self, inputs: list[torch.Tensor], positions: list[torch.Tensor], caches: list[PipelineCache],
                     masks: list[torch.Tensor | None], logits_at: list[torch.Tensor]) -> list[torch.Tensor]:
        future = self.send_many(inputs, positions, caches, masks, logits_at)
        return list(wait_output(future, self.device).float().split([a.numel() for a in logits_at]))

    def send_many(self, inputs: list[torch.Tensor], positions: list[torch.Tensor], caches: list[PipelineCache],
                  masks: list[torch.Tensor | None], logits_at: list[torch.Tensor]) -> concurrent.futures.Future:
        """Run stage 1's layers over a micro-batch and send it down the chain; the future gets
        the logits rows (every session's, concatenated) without holding this thread meanwhile."""
        epoch = caches[0].epoch
        if any(cache.epoch != epoch for cache in caches):
            raise StageUnavailable("sessions of two pipeline chains in one micro-batch")
        lengths = [x.shape[0] for x in inputs]
        # The other stages rebuild each mask from their own (equal) cache length.
        tree_masks = [None if m is None else Tensor.from_torch(m[:, -n:]) for m, n in zip(masks, lengths)]
        flat_positions = torch.cat(positions)
        started = time.perf_counter()
        hidden = self.local.forward_ragged(torch.cat(inputs), flat_positions, ragged_bounds(lengths), caches, masks)
        sleep_rest(started, self.delay_s)
        sids, at = [cache.sid for cache in caches], [a.tolist() for a in logits_at]
        hidden_frame, positions_frame = Tensor.from_torch(hidden), Tensor.from_torch(flat_positions.long())
        return self.client.submit(epoch, lambda fid: StageForward(fid, sids, lengths, positions_frame, tree_masks,
                                                                  at, hidden_frame))
