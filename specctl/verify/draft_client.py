"""The target instance's link to the draft server: one TCP connection, many sessions
multiplexed by tag, at most one request in flight per session. When the link is down
every call returns None at once, so sessions keep decoding autoregressively; a
background task reconnects with exponential backoff. Tags belong to one connection
epoch: after a reconnect, sessions open new draft sessions from their current text."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import ssl as ssl_module
import time

from specctl.errors import VocabMismatch, connection_failure
from specctl.net.framing import read_message
from specctl.net.handshake import AuthError, open_peer
from specctl.net.protocol import (CloseSession, Error, Graft, Level, NextLevel, OpenLevels, OpenSession, Proposal,
                                  Propose, Reroot, SessionOpened, StatsRequest, encode)
from specctl.spec.params import SamplingParams

# A session refused for these is asked for again after REOPEN_AFTER_S: the server's sessions
# end, and other targets' (StarSD admission); any other refusal holds until a reconnect.
TRANSIENT_REFUSALS = frozenset({"capacity", "admission"})
REOPEN_AFTER_S = 1.0
Refusal = tuple[int, float]  # (link epoch, when to ask for a session again: inf = not on that link)
log = logging.getLogger("specctl.verify.draft")
Handle = tuple[int, int]  # (connection epoch, tag) of a draft session
# A request past the client's timeout drops the link only if the server says nothing at all: a
# stats request (answered on its event loop, beside the compute) gets nothing back within
# PROBE_S. A server swamped with long prompts still answers: it is slow, not hung.
PROBE_S = 2.0
# A live target says something at least this often, sessions or not: a draft server that is
# full may close a target connection silent for three of these (draft.opening.STALE_TARGET_S),
# which is what a stopped or hung target process leaves behind.
HEARTBEAT_S = 10.0


class DraftClient:
    def __init__(self, host: str, port: int, *, model: str, fingerprint: str, auth_token: str | None = None,
                 ssl: ssl_module.SSLContext | None = None, timeout_s: float = 30.0) -> None:
        self.host, self.port, self.model, self.fingerprint = host, port, model, fingerprint
        self.auth_token, self.ssl, self.timeout_s = auth_token, ssl, timeout_s
        self.epoch = 0  # increments on every successful connect
        self.connected = asyncio.Event()
        self.last_error: str | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[tuple[str, int], asyncio.Future] = {}
        self._reqs = itertools.count(1)
        self.reconnects = 0
        self._given_up: str | None = None  # why this side dropped the link, while run() has not said it
        self._heard = asyncio.Event()  # set by every frame that comes
        self._probe: asyncio.Task | None = None  # the one liveness probe in flight

    async def connect_once(self) -> None:
        reader, writer, _ = await open_peer(self.host, self.port, role="target", model=self.model,
                                            fingerprint=self.fingerprint, auth_token=self.auth_token, ssl=self.ssl)
        self._writer = writer
        self.epoch += 1
        self.connected.set()
        self._reader = reader

    async def run(self, first_connected: asyncio.Future | None = None) -> None:
        """Keep the link up until cancelled. ``first_connected`` gets the first attempt's
        outcome (a vocabulary mismatch or auth failure is worth failing start-up for)."""
        backoff = 0.2
        while True:
            try:
                await self.connect_once()
                if first_connected is not None and not first_connected.done():
                    first_connected.set_result(True)
                elif self.last_error is not None:
                    log.info("reconnected to the draft server at %s:%d; speculating again", self.host, self.port)
                backoff = 0.2
                self.last_error = None
                heartbeat = asyncio.create_task(self._heartbeat(self._writer))
                try:
                    await self._read_loop()
                finally:
                    heartbeat.cancel()
            except (VocabMismatch, AuthError) as exc:
                self.last_error = str(exc)
                if first_connected is not None and not first_connected.done():
                    first_connected.set_exception(exc)
                    return
                log.error("draft server refused us: %s", exc)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001
                # the link dropped here (a hung server) ends the read loop with an IncompleteReadError: say why
                given_up, self._given_up = self._given_up, None
                why = given_up or ("it closed the connection" if isinstance(exc, asyncio.IncompleteReadError)
                                   else connection_failure(exc))
                if self.connected.is_set():  # once per loss, not per reconnection attempt
                    log.warning("lost the draft server at %s:%d (%s); decoding autoregressively and reconnecting",
                                self.host, self.port, why)
                self.last_error = why
                if first_connected is not None and not first_connected.done():
                    first_connected.set_result(False)  # not fatal: decode autoregressively meanwhile
            finally:
                self._drop_link()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
            self.reconnects += 1

    def _give_up(self, why: str) -> None:
        """A server that stops answering (a hung process or box) keeps its connection open, and
        every session would wait out the timeout again at each round: close it, so sessions
        decode autoregressively at once (no writer: every request None) while ``run`` reconnects."""
        if self._writer is not None:
            log.warning("the draft server at %s:%d gave %s; dropping the link", self.host, self.port, why)
            self._given_up = why
            self._writer.close()  # the read loop ends; run() drops the link and reconnects
            self._writer = None  # meanwhile every request is None at once

    @staticmethod
    async def _heartbeat(writer: asyncio.StreamWriter) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            if writer.is_closing():
                return
            writer.write(encode(StatsRequest()))

    async def _answers(self) -> bool:
        """Whether the server answers at all (one probe shared by every session that asks)."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_once())
        return await asyncio.shield(self._probe)

    async def _probe_once(self) -> bool:
        writer = self._writer
        if writer is None:
            return True  # dropped already: nothing to give up
        self._heard.clear()
        writer.write(encode(StatsRequest()))
        try:
            await asyncio.wait_for(self._heard.wait(), PROBE_S)
        except asyncio.TimeoutError:
            return False
        log.info("the draft server at %s:%d is slow (a request past %g s) but answers: keeping the link", self.host,
                 self.port, self.timeout_s)
        return True

    def _drop_link(self) -> None:
        self.connected.clear()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for future in self._pending.values():
            if not future.done():
                future.set_result(None)
        self._pending.clear()

    async def _read_loop(self) -> None:
        while True:
            message = await read_message(self._reader)
            self._heard.set()
            if isinstance(message, SessionOpened):
                key = ("req", message.req)
            elif isinstance(message, (Proposal, Level)):
                key = ("tag", message.tag)
            elif isinstance(message, Error):
                key = ("req", message.req) if message.req is not None else ("tag", message.tag)
                # a full server is no fault (the session drafts once it has room): not a warning per
                # session; nor an answer nobody waits for (a session closed while its request was out)
                log.log(logging.DEBUG if message.code in TRANSIENT_REFUSALS or key not in self._pending
                        else logging.WARNING, "draft server error %s: %s", message.code, message.message)
            else:
                continue
            future = self._pending.pop(key, None)
            if future is not None and not future.done():
                future.set_result(message)
            elif isinstance(message, SessionOpened) and self._writer is not None:
                # Nobody waits for this session any more (its opener was cancelled or timed
                # out after asking): close it, or it would hold draft state until we disconnect.
                self._writer.write(encode(CloseSession(message.tag)))

    async def _request(self, key: tuple[str, int], message, timeout_s: float | None = None) -> object | None:
        if self._writer is None:
            return None
        future = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            self._writer.write(encode(message))
            reply = await asyncio.wait_for(future, timeout_s or self.timeout_s)
        except ConnectionError:
            return None
        except asyncio.TimeoutError:
            # Only past the client's own timeout: a caller's deadline is its own business — a fused
            # round's shorter one, or a first proposal's longer one that waits for its prompt's
            # prefill, which other sessions' long prompts can delay past it on a loaded server.
            if timeout_s is None and not await self._answers():
                self._give_up(f"no answer within {self.timeout_s:g} s, nor to a stats request within {PROBE_S:g} s")
            return None
        finally:
            self._pending.pop(key, None)
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # Cancelled just as the reply came (wait_for then returns it): a session it
            # opened has nobody to close it but us.
            if isinstance(reply, SessionOpened):
                self.close((self.epoch, reply.tag))
            raise asyncio.CancelledError
        return reply

    async def open(self, prompt: list[int], *, temperature: float, top_p: float, top_k: int, seed: int,
                   max_tokens: int, rules: SamplingParams | None = None, generated: int = 0,
                   reproducible: bool = False) -> Handle | Error | None:
        """(epoch, tag) of a new draft session; the server's Error when it refused the session; None
        when the draft is unavailable (no link, no answer in time). ``rules``: the
        request's parameters, whose logit rules, grammar and min_p the draft follows; ``generated``:
        how many of the prompt's last tokens are output already; ``reproducible``: drafted as a
        cold start alone would (OpenSession.reproducible: a seeded sample's)."""
        epoch, req = self.epoch, next(self._reqs)
        rules = rules or SamplingParams()
        reply = await self._request(("req", req), OpenSession(
            req, prompt, temperature, top_p, top_k, seed, max_tokens, rules.min_p, reproducible,
            list(rules.sampler_order), rules.cache_salt, **draft_rules(rules, generated)))
        return self._opened(reply, epoch)

    def _opened(self, reply, epoch: int) -> Handle | Error | None:
        """An open's outcome: the session's handle (on a link still up), the server's refusal, or None."""
        if isinstance(reply, SessionOpened) and epoch == self.epoch:
            return epoch, reply.tag
        return reply if isinstance(reply, Error) else None

    async def propose(self, handle: Handle, path: list[int], tokens: list[int],
                      timeout_s: float | None = None, max_depth: int = 0) -> Proposal | None:
        epoch, tag = handle
        if epoch != self.epoch:
            return None
        reply = await self._request(("tag", tag), Propose(tag, path, tokens, max_depth), timeout_s)
        return reply if isinstance(reply, Proposal) and epoch == self.epoch else None

    async def open_levels(self, prompt: list[int], width: int, topk: int, capacity: int,
                          spread: str = "likeliest", rules: SamplingParams | None = None,
                          generated: int = 0) -> Handle | Error | None:
        """A SpecPipe tree-level session; the server's Error when it refused; None when the draft
        is unavailable. ``rules``: the request's parameters, whose logit rules and grammar the
        levels follow; ``generated``: how many of the text's last tokens, with the root, are output."""
        epoch, req = self.epoch, next(self._reqs)
        reply = await self._request(("req", req), OpenLevels(req, prompt, width, topk, capacity, spread,
                                                             **draft_rules(rules or SamplingParams(), generated)))
        return self._opened(reply, epoch)

    async def next_level(self, handle: Handle, frontier: list[int]) -> Level | None:
        epoch, tag = handle
        if epoch != self.epoch:
            return None
        reply = await self._request(("tag", tag), NextLevel(tag, frontier))
        return reply if isinstance(reply, Level) and epoch == self.epoch else None

    def reroot(self, handle: Handle, committed: int, new_root: int, token: int, position: int) -> None:
        """Fire and forget, in order with the session's next level request."""
        self._fire(handle, Reroot(handle[1], committed, new_root, token, position))

    def graft(self, handle: Handle, parent: int, tokens: list[int]) -> None:
        """A predicted chain hung under ``parent``; fire and forget, in order with the rest."""
        self._fire(handle, Graft(handle[1], parent, tokens))

    def _fire(self, handle: Handle, message) -> None:
        if handle[0] == self.epoch and self._writer is not None:
            try:
                self._writer.write(encode(message))
            except (ConnectionError, RuntimeError):
                pass  # the link is going: the next level request finds out

    def close(self, handle: Handle | None, tokens: list[int] | None = None) -> None:
        """Fire and forget; ``tokens``: the text committed after the session's last proposal."""
        if handle is None or handle[0] != self.epoch or self._writer is None:
            return
        try:
            self._writer.write(encode(CloseSession(handle[1], tokens or [])))
        except (ConnectionError, RuntimeError):
            pass


def refusal(reply: Error | None, epoch: int) -> Refusal:
    """When to ask again after an open on link ``epoch`` got ``reply`` instead of a session:
    REOPEN_AFTER_S after a refusal for room, never on that link otherwise (pure but the clock)."""
    transient = isinstance(reply, Error) and reply.code in TRANSIENT_REFUSALS
    return epoch, time.monotonic() + REOPEN_AFTER_S if transient else math.inf


def may_ask_again(refused: Refusal | None, epoch: int) -> bool:
    """Whether a session refused as ``refused`` may be asked for now, on link ``epoch``."""
    return refused is None or refused[0] != epoch or time.monotonic() >= refused[1]


def draft_rules(rules: SamplingParams, generated: int = 0) -> dict:
    """The request's logit rules and grammar as the opening messages carry them (protocol.DraftRules)."""
    kind, spec = rules.structured or ("", "")
    start, end = rules.thinking_markers or ((), ())
    return dict(structured_kind=kind, structured_spec=spec, generated=generated,
                presence_penalty=rules.presence_penalty, frequency_penalty=rules.frequency_penalty,
                repetition_penalty=rules.repetition_penalty, min_tokens=rules.min_tokens,
                logit_bias=dict(rules.logit_bias), bad_words=[list(word) for word in rules.bad_words],
                penalty_last_n=rules.penalty_last_n, allowed_token_ids=list(rules.allowed_token_ids),
                thinking_budget=-1 if rules.thinking_budget is None else rules.thinking_budget,
                thinking_start=list(start), thinking_end=list(end))
