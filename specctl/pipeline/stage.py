"""A pipeline stage i > 1 (``specctl verify --stage i/n``): it holds layers [a, b) (the last
stage also the final norm and LM head), accepts the previous stage's connection, runs its
layers over each micro-batch in arrival order and passes the hidden states on; the last
stage sends the logits rows back, relayed up the chain. Frames are read as they arrive, so
a control frame (StageDrop) takes effect ahead of the forwards queued for the compute.

A chain is built per connection: when stage i-1 connects, stage i connects to stage i+1
for it. Whatever breaks (a stage dies, a link drops) tears the chain down from there in
both directions and frees every session's KV on every stage; stage 1 then fails its
sessions with a clear error and reconnects, and new sessions work without restarting
the other stages."""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_module
import time
from dataclasses import dataclass

from specctl.engine.kv_cache import KVPool
from specctl.errors import SpecctlError, StageUnavailable
from specctl.net.framing import read_message
from specctl.net.handshake import server_handshake
from specctl.net.protocol import (Error, ProtocolError, StageClose, StageDrop, StageForward, StageKeep, StageOpen,
                                  StageOutput, Stats, StatsRequest, encode)
from specctl.pipeline.link import STAGE_FRAME_BYTES, StageLink
from specctl.pipeline.worker import StageStats, StageWorker
from specctl.runtime.compute import ComputeLane, ComputeThread
from specctl.runtime.listen import ListenConfig, ListeningServer, peer_name

log = logging.getLogger("specctl.pipeline")
WORK_QUEUE_FRAMES = 256  # frames read ahead of the compute: enough for every level in flight, bounded memory


@dataclass(slots=True)
class StageServerConfig(ListenConfig):
    index: int = 2
    count: int = 2
    next_address: tuple[str, int] | None = None  # None on the last stage
    delay_s: float = 0.0  # emulated device time of a forward, its real compute included (bench pipeline)

    def __post_init__(self) -> None:
        ListenConfig.__post_init__(self)
        if not 2 <= self.index <= self.count:
            raise ValueError(f"a stage server is stage 2..n, got {self.index}/{self.count}")
        if (self.next_address is None) != (self.index == self.count):
            raise ValueError("every stage but the last needs the next stage's address")
        if self.delay_s < 0:
            raise ValueError("delay_s must be >= 0")


class StageServer(ListeningServer):
    def __init__(self, model, config: StageServerConfig, ssl=None, ssl_client: ssl_module.SSLContext | None = None,
                 compute: ComputeLane | None = None) -> None:
        super().__init__()
        self.model, self.config, self.ssl, self.ssl_client = model, config, ssl, ssl_client
        self.compute = compute or ComputeThread(f"stage{config.index}-compute").lane(owns_thread=True)
        self.pool = KVPool(config.kv_budget_bytes)
        self.stats = StageStats()
        self.chains = 0  # upstream connections served (each one a chain)
        self.workers: set[StageWorker] = set()  # one per live chain: its sessions' KV
        self.started = time.perf_counter()

    @property
    def name(self) -> str:
        return f"stage {self.config.index}/{self.config.count}"

    def snapshot(self) -> dict:
        first, last = self.model.decoder.layer_range
        stats = {"model": self.model.name, "stage": f"{self.config.index}/{self.config.count}",
                 "layers": f"{first}:{last}", "kv_used_mb": round(self.pool.used_bytes / 2**20, 2),
                 "sessions": self.pool.sessions, "chains": self.chains, "rejected_requests": self.rejected_requests}
        stats.update(self.stats.to_dict())
        return stats

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._live.track(writer)
        peer = peer_name(writer)
        outgoing: asyncio.Queue = asyncio.Queue()
        send = lambda message: outgoing.put_nowait(encode(message))  # noqa: E731
        link: StageLink | None = None
        worker = StageWorker(self.model.decoder, self.pool, self.stats)
        self.workers.add(worker)
        try:
            async def build_chain(hello) -> None:  # the whole chain exists before stage 1 is welcomed
                nonlocal link
                if hello.role == "stage":
                    self._check_layers(hello.layers)
                    link = await self._link_next(send)

            hello = await server_handshake(
                reader, writer, role="stage", model=self.model.name, fingerprint=self.model.vocab_fingerprint,
                max_sessions=self.config.max_sessions, auth_token=self.config.auth_token,
                accept_roles={"stage": True, "monitor": False, "client": False, "gateway": False},
                before_welcome=build_chain)
            async with asyncio.TaskGroup() as group:
                group.create_task(self._write_loop(outgoing, writer))
                watch = None
                try:
                    if hello.role == "stage":
                        self.chains += 1
                        if link is not None:  # the chain ends with the next link too
                            watch = group.create_task(self._end_with(link, writer))
                    await self._read_loop(reader, send, worker, link, hello.role == "stage")
                finally:
                    outgoing.put_nowait(None)
                    if watch is not None:  # the upstream ended first: not the next stage's doing
                        watch.cancel()
        except (SpecctlError, asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError) as exc:
            log.info("%s: upstream %s closed: %s", self.name, peer, exc or type(exc).__name__)
        except Exception:  # noqa: BLE001
            log.exception("%s: upstream %s failed", self.name, peer)
        finally:
            writer.close()
            if link is not None:
                await link.close()
            self.workers.discard(worker)
            if worker.caches:
                self.compute.submit_nowait(worker.close_all)

    def _check_layers(self, previous: list[int]) -> None:
        first, _ = self.model.decoder.layer_range
        if len(previous) != 2 or previous[1] != first:
            held = f"layers {previous[0]}:{previous[1]}" if len(previous) == 2 else "no layer range"
            raise StageUnavailable(f"pipeline stage {self.config.index} holds layers from {first} but the previous "
                                   f"stage sent {held}: every stage must start where the previous one ends "
                                   "(check --layers and --stage on both)")

    async def _link_next(self, send) -> StageLink | None:
        if self.config.next_address is None:
            return None
        host, port = self.config.next_address
        link = StageLink(host, port, model=self.model.name, fingerprint=self.model.vocab_fingerprint,
                         on_reply=send, auth_token=self.config.auth_token, ssl=self.ssl_client,
                         layers=self.model.decoder.layer_range)
        try:
            await link.connect()
        except StageUnavailable:
            raise  # a stage further down is missing: its message says which
        except (OSError, SpecctlError, asyncio.TimeoutError) as exc:
            raise StageUnavailable(
                f"pipeline stage {self.config.index + 1} at {link.address} is unreachable from stage "
                f"{self.config.index} ({exc or type(exc).__name__}); start it, or check --pipeline") from None
        return link

    @staticmethod
    async def _end_with(link: StageLink, writer: asyncio.StreamWriter) -> None:
        await link.closed.wait()
        log.warning("the next pipeline stage at %s went away (%s): closing this chain", link.address, link.error)
        writer.transport.abort()

    async def _read_loop(self, reader, send, worker: StageWorker, link: StageLink | None, chain: bool) -> None:
        """Read frames as they arrive: control frames (StageDrop, StatsRequest) take effect at
        once and go on down the chain; the rest queue, in order, for ``_work_loop``."""
        work: asyncio.Queue = asyncio.Queue(WORK_QUEUE_FRAMES)
        worker_task = asyncio.create_task(self._work_loop(work, send, worker, link))
        try:
            while True:
                try:
                    message = await read_message(reader, STAGE_FRAME_BYTES if chain else self.config.max_frame_bytes)
                except ProtocolError as exc:  # this connection ends (its chain with it); the stage carries on
                    self.reject("stage upstream", str(exc))
                    send(Error("protocol", str(exc)))
                    return
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                if isinstance(message, StatsRequest):
                    send(Stats("stage", self.snapshot()))
                    if chain and link is not None:  # every stage's answer comes back up the chain
                        link.post(message)
                elif not chain:
                    send(Error("unexpected", f"a {type(message).__name__} needs a stage connection"))
                elif isinstance(message, StageDrop):
                    worker.mark_dead(message, WORK_QUEUE_FRAMES)
                    if link is not None:
                        link.post(message)
                elif isinstance(message, (StageForward, StageOpen, StageKeep, StageClose)):
                    await work.put(message)
                else:
                    send(Error("unexpected", f"a pipeline stage does not handle {type(message).__name__}"))
        finally:
            worker_task.cancel()
            await asyncio.gather(worker_task, return_exceptions=True)

    async def _work_loop(self, work: asyncio.Queue, send, worker: StageWorker, link: StageLink | None) -> None:
        """Forwards and KV changes in arrival order, on the compute thread."""
        index = self.config.index
        while True:
            message = await work.get()
            if isinstance(message, StageForward):
                try:
                    dead = worker.dead_rows(message)
                    if all(rows is None for rows in dead):  # no device time either: nothing runs
                        out = await self.compute.run(worker.hollow, message)
                    else:
                        started = time.perf_counter()
                        out = await self.compute.run(worker.forward, message, dead)
                        rest = self.config.delay_s - (time.perf_counter() - started)
                        if rest > 0:  # emulated device time, the real compute inside it (runtime/emulation.sleep_rest)
                            await asyncio.sleep(rest)
                except Exception as exc:  # noqa: BLE001 - that micro-batch fails, the chain goes on
                    self.reject("stage upstream", f"forward {message.fid}: {exc}")
                    send(Error("stage_failed", f"pipeline stage {index}: {exc}", req=message.fid))
                    continue
                if isinstance(out, StageOutput):
                    send(out)
                else:
                    link.post(out)
            else:
                if isinstance(message, StageClose):
                    worker.dead.pop(message.sid, None)
                try:
                    await self.compute.run(self._apply, worker, message)
                except Exception as exc:  # noqa: BLE001 - the session's next forward reports it
                    self.reject("stage upstream", f"{type(message).__name__} {message.sid}: {exc}")
                    worker.failed[message.sid] = f"pipeline stage {index}: {exc}"
                if link is not None:
                    link.post(message)

    @staticmethod
    def _apply(worker: StageWorker, message) -> None:
        if isinstance(message, StageOpen):
            worker.open(message)
        elif isinstance(message, StageKeep):
            worker.keep(message)
        else:
            worker.failed.pop(message.sid, None)
            worker.close(message.sid)
