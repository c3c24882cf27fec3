"""The roles behind the gateway: target instances it sends requests to (least loaded
first, failing over before the first token) and draft servers it watches. A poller keeps
a stats snapshot of every role; a role that stops answering is shown as down and comes
back on its own when it answers again."""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl as ssl_module
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import numpy as np

from specctl.engine.prefix_cache import common_prefix
from specctl.config import repeated
from specctl.errors import ConfigError
from specctl.gateway.api import ApiError
from specctl.gateway.metrics import GatewayMetrics
from specctl.gateway.role_stats import draft_servers
from specctl.gateway.routing import TargetView, pick_target
from specctl.gateway.waiting import Ticket, WaitingLine
from specctl.net.protocol import Welcome
from specctl.runtime.loop import parse_hostport
from specctl.spec.params import SamplingParams
from specctl.verify.client import RemoteError, TargetConnection, TargetStream, flush_cache, probe

log = logging.getLogger("specctl.gateway")

RECENT_PROMPTS = 64  # per instance, for cache-aware routing (a lookup compares the prompt with each)
RATE_SAMPLES = 64  # polls kept (gateway.role_stats.recent_rate measures over them)
ROLE_ANSWER_S = 5.0  # how long a role may take to answer a stats probe or a flush before it counts as down
# an instance silent this long (its polls unanswered: a hung process or box, a network that drops
# without a reset) is lost: its streams go on elsewhere rather than wait for it
STALLED_AFTER_S = 10.0
LOST = {"disconnected", "unavailable"}  # an instance gone (or its pipeline broken) mid-stream
RETRYABLE = {"unreachable", "disconnected", "capacity", "unavailable"}  # nothing was generated yet: another instance may take it


@dataclass(slots=True)
class RoleLink:
    role: str  # "target" or "draft"
    host: str
    port: int
    up: bool = False
    stats: dict = field(default_factory=dict)
    welcome: Welcome | None = None
    inflight: int = 0
    error: str = ""
    seen_at: float = 0.0
    silent_since: float | None = None  # monotonic start of the first of the polls it has not answered since
    connection: TargetConnection | None = None  # reused by every request to this instance
    connecting: asyncio.Lock = field(default_factory=asyncio.Lock)
    # (cache salt, prompt) of the requests it prefilled lately or is prefilling: what its prefix
    # cache holds or will hold (cache-aware routing; a prefix is reused only within its salt)
    prefilled: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RECENT_PROMPTS))
    # (time, tokens generated since it started) at its last polls: its recent throughput (recent_rate)
    generated: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RATE_SAMPLES))

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def view(self, prompt: np.ndarray | None = None, salt: str = "") -> TargetView:
        capacity = self.welcome.max_sessions if self.welcome else 0
        match = 0 if prompt is None else max(
            (common_prefix(done, prompt) for held_salt, done in self.prefilled if held_salt == salt), default=0)
        return TargetView(self.up, self.inflight, capacity, int(self.stats.get("sessions", 0)), match)

    def snapshot(self) -> dict:
        return {"role": self.role, "address": self.address, "up": self.up, "error": self.error,
                "seen_at": self.seen_at or None, "stats": self.stats}


def _forget(prompts: collections.deque, tokens: np.ndarray) -> None:
    """Drop this request's record (the very array) of a prompt it did not get prefilled there."""
    for i, (_, held) in enumerate(prompts):
        if held is tokens:
            del prompts[i]
            return


class Upstream:
    def __init__(self, targets: list[str], drafters: list[str] = (), fingerprint: str | None = None,
                 auth_token: str | None = None, ssl: ssl_module.SSLContext | None = None,
                 metrics: GatewayMetrics | None = None, poll_interval_s: float = 0.5, max_waiting: int = 1024,
                 queue_timeout_s: float = 600.0) -> None:
        self.targets = [RoleLink("target", *parse_hostport(t)) for t in targets]
        self.drafters = [RoleLink("draft", *parse_hostport(d)) for d in drafters]
        for flag, links in (("--target", self.targets), ("--drafter", self.drafters)):
            if (twice := repeated([link.address for link in links])) is not None:  # one instance counted twice
                raise ConfigError(f"{flag} names {twice} twice: each instance once")
        self.fingerprint, self.auth_token, self.ssl = fingerprint, auth_token, ssl
        self.metrics, self.poll_interval_s = metrics, poll_interval_s
        # generations waiting for a session while every instance is at capacity (gateway.waiting)
        self.waiting = WaitingLine(max_waiting, queue_timeout_s, recheck_s=poll_interval_s)

    async def _poll(self, link: RoleLink) -> None:
        asked = time.monotonic()
        try:
            welcome, stats = await asyncio.wait_for(probe(link.host, link.port, self.auth_token, self.ssl),
                                                    ROLE_ANSWER_S)
        except Exception as exc:  # noqa: BLE001 - unreachable, refused or misbehaving: shown as down, never fatal
            self._down(link, str(exc) or type(exc).__name__)
            link.silent_since = link.silent_since or asked
            self._drop_if_stalled(link)
            return
        link.silent_since = None
        link.welcome, link.stats, link.seen_at = welcome, stats, time.time()
        if "tokens" in stats:
            link.generated.append((link.seen_at, stats["tokens"]))
        if link.role == "target" and self.fingerprint and welcome.fingerprint != self.fingerprint:
            self._down(link, f"it serves {welcome.model}, whose vocabulary differs from the gateway's tokenizer: "
                             "every --target must serve the model the gateway was started for")
            return
        if stats.get("pipeline_connected") is False:  # stage 1 answers, but its chain is broken: it would refuse
            self._down(link, f"its pipeline is down ({stats.get('pipeline_error') or 'reconnecting'})")
            return
        if not link.up:
            log.info("%s %s is up (%s)", link.role, link.address, welcome.model)
        link.up, link.error = True, ""

    @staticmethod
    def _down(link: RoleLink, error: str) -> None:
        """The role is down; said in the log when it was up, or on the first poll (never up yet)."""
        if link.up or not link.error:
            log.warning("%s %s is down: %s", link.role, link.address, error)
        link.up, link.error = False, error

    def _drop_if_stalled(self, link: RoleLink) -> None:
        """Close the connection of an instance silent for STALLED_AFTER_S while another is up:
        the generations on it end as lost (gateway.choices goes on with them there), and the
        instance, once it answers again, frees their sessions as it finds the connection closed.
        With no other instance up they wait for it: slow beats failed."""
        silent = time.monotonic() - (link.silent_since or time.monotonic())
        if link.connection is None or link.connection.closed or silent < STALLED_AFTER_S \
                or not any(other.up for other in self.targets if other is not link):
            return
        reason = f"target instance {link.address} stopped answering ({link.error}) for {silent:.0f} s mid-stream"
        log.warning("%s; its generations go on elsewhere", reason)
        link.connection.close(reason)
        link.connection = None

    def _discover_drafters(self) -> None:
        known = {(d.host, d.port) for d in self.drafters}
        for target in self.targets:
            for host, port in map(parse_hostport, draft_servers(target.stats)):
                if (host, port) not in known:
                    self.drafters.append(RoleLink("draft", host, port))
                    known.add((host, port))

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(link) for link in self.targets + self.drafters))
        self._discover_drafters()
        if self.metrics:
            for link in self.targets + self.drafters:
                self.metrics.record_role(link.role, link.address, link.up, link.stats)

    async def poll_forever(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.poll_interval_s)

    async def flush_caches(self) -> list[dict]:
        """Every known role's prefix cache emptied — the target instances and the draft servers
        they use: a line a role, with what it dropped or why it could not."""
        async def flush(link: RoleLink) -> dict:
            line = {"role": link.role, "address": link.address}
            try:
                done = await asyncio.wait_for(flush_cache(link.host, link.port, self.auth_token, self.ssl),
                                              ROLE_ANSWER_S)
            except Exception as exc:  # noqa: BLE001 - down or refusing: said in its line, the others still flushed
                return {**line, "error": str(exc) or type(exc).__name__}
            link.prefilled.clear()  # routing's picture of what it holds
            return {**line, "entries": done.entries, "freed_mb": round(done.freed_bytes / 2**20, 2)}

        return list(await asyncio.gather(*(flush(link) for link in self.targets + self.drafters)))

    def views(self, prompt: np.ndarray | None = None, salt: str = "") -> list[TargetView]:
        return [t.view(prompt, salt) for t in self.targets]

    @asynccontextmanager
    async def stream(self, prompt: list[int], params: SamplingParams, priority: int = 0, request_id: str = "",
                     resumed: tuple[int, ...] = (), waits: Callable[[], None] | None = None
                     ) -> AsyncIterator[tuple[TargetStream, object]]:
        """(stream, first event) of a generation on the least-loaded instance. Failures before
        the first token move on to the next instance; while every instance that is up is at
        capacity the generation waits its turn (gateway.waiting, by ``priority``); with none
        up, a 503. ``resumed``: the output a lost instance already sent (gateway.choices goes
        on from it); an instance lost mid-stream is marked down. ``waits`` is called when the
        generation takes its place in the waiting line."""
        tried: set[int] = set()  # instances that failed this generation (down now)
        full: set[int] = set()  # instances that said they were full (other clients' sessions) since the last wait
        tokens = np.asarray([*prompt, *resumed], dtype=np.int64)  # the text the instance prefills
        entered = time.perf_counter()
        ticket: Ticket | None = None  # its place in the waiting line, once it has waited
        if self.waiting.ahead(priority):  # no one overtakes those waiting before it
            ticket = self._ticket(priority, waits)
            await self._wait(ticket)
        while True:
            index = pick_target(self.views(tokens, params.cache_salt), frozenset(tried | full))
            if index is None:
                if not any(t.up for i, t in enumerate(self.targets) if i not in tried):
                    reasons = "; ".join(f"{t.address}: {t.error}" for t in self.targets if not t.up and t.error)
                    raise ApiError(503, f"no target instance is reachable{f' ({reasons})' if reasons else ''}; "
                                        "retry later", type="server_error", code="no_capacity", retry_after=1)
                ticket = ticket or self._ticket(priority, waits)
                await self._wait(ticket)
                full.clear()
                continue
            link = self.targets[index]
            picked = time.perf_counter()
            link.inflight += 1
            # Counted as prefilled from now: a request that starts the same way while this one's
            # prefill runs waits there for it and restores it (engine.prefill_gate) — a
            # request's n choices, a burst over one system prompt.
            link.prefilled.append((params.cache_salt, tokens))
            stream, first = None, None
            try:
                try:
                    stream = (await self._connection(link)).generate(prompt, params, request_id, resumed)
                    first = await stream.next()
                except RemoteError as exc:
                    if exc.code not in RETRYABLE:
                        raise
                    if exc.code == "capacity":
                        full.add(index)
                    else:
                        link.up, link.error = False, str(exc)
                        tried.add(index)
                    log.warning("target %s: %s; trying another (request %s)", link.address, exc, request_id)
                    continue
                if ticket is not None:
                    self.waiting.wake()  # its turn came and it has a slot: the next one may find one too
                if self.metrics:
                    self.metrics.queue_time.observe(picked - entered)
                try:
                    yield stream, first
                except RemoteError as exc:
                    if exc.code in LOST:  # until the poller finds it up again
                        self._down(link, str(exc))
                    raise
                return
            finally:
                if first is None:  # it never started there
                    _forget(link.prefilled, tokens)
                if stream is not None:
                    stream.close()  # cancels it on the target unless it finished
                link.inflight -= 1
                self.waiting.wake()  # a session freed (or was never taken): the head of the line tries

    def _ticket(self, priority: int, waits: Callable[[], None] | None) -> Ticket:
        ticket = self.waiting.ticket(priority)
        if waits is not None:
            waits()
        return ticket

    async def _wait(self, ticket: Ticket) -> None:
        """A turn in the waiting line, counted in the metrics while it waits."""
        if self.metrics:
            self.metrics.waiting.inc()
        try:
            await self.waiting.wait(ticket)
        finally:
            if self.metrics:
                self.metrics.waiting.dec()

    async def _connection(self, link: RoleLink) -> TargetConnection:
        """The instance's pooled connection, (re)made when there is none or it dropped."""
        async with link.connecting:
            if link.connection is None or link.connection.closed:
                link.connection = await TargetConnection(link.host, link.port, "gateway", self.auth_token,
                                                         self.ssl).connect()
            return link.connection

    def close(self) -> None:
        for link in self.targets:
            if link.connection is not None:
                link.connection.close()
                link.connection = None

    def snapshot(self) -> dict:
        return {"targets": [t.snapshot() for t in self.targets], "drafters": [d.snapshot() for d in self.drafters]}
