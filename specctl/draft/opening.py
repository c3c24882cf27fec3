"""Opening a draft session on the draft server: admission (capacity, StarSD's plan), the
session's state made on the compute thread, then its prompt's KV fed in chunks, each a job of
its own so that other sessions draft between them; the session's first proposal waits for it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from specctl.draft.connection import Connection
from specctl.draft.plan import open_refusal
from specctl.engine.prefill_gate import prefill_turn
from specctl.errors import KVBudgetExceeded, SpecctlError
from specctl.net.protocol import Error, OpenLevels, OpenSession, SessionOpened
from specctl.runtime.compute import timed
from specctl.spec.structured import ll_tokenizer

log = logging.getLogger("specctl.draft")
STALE_TARGET_S = 30.0  # three missed heartbeats (verify.draft_client.HEARTBEAT_S)


class SessionOpening:
    """DraftServer's handling of OpenSession and OpenLevels (its tables, compute lane and
    connections are the server's)."""

    def _open(self, conn: Connection, message: OpenSession | OpenLevels, group: asyncio.TaskGroup) -> None:
        if isinstance(message, OpenLevels) and self.model.decoder.device.type == "meta":
            conn.send(Error("bad_request", f"this draft server drafts by {self.table.drafter.name} lookup and loaded "
                                           "no weights; SpecPipe's tree levels need a draft model: run it with "
                                           "--mode tree", req=message.req))
            return
        other_targets = sum(1 for c in self.connections.values() if c.tags and c is not conn)
        refusal = open_refusal(self.config, self.active_sessions, len(conn.tags), other_targets)
        if refusal is not None:
            if self.active_sessions >= self.config.max_sessions:
                self._close_silent_targets(conn)  # room for the retry (a second later), if a hung target held it
            conn.send(Error(*refusal, req=message.req))
            return
        tag = next(self._tags)
        conn.tags.add(tag)
        group.create_task(self._open_on_compute(conn, tag, message))

    def _close_silent_targets(self, asking: Connection) -> None:
        """Close the connections of targets that hold sessions but have sent nothing for
        STALE_TARGET_S (a live target's heartbeat comes every verify.draft_client.HEARTBEAT_S):
        a stopped or hung process keeps its connection open, and its sessions would keep the
        server full for ever. Only when the server is full: closing frees them by the usual
        disconnect path, and a target that resumes reconnects and opens them again."""
        now = time.monotonic()
        for other in list(self.connections.values()):
            if other is asking or not other.tags or now - other.heard_at < STALE_TARGET_S:
                continue
            log.warning("target %s holds %d session%s but has sent nothing for %.0f s while the server is full: "
                        "closing its connection (a stopped or hung process; it reconnects if it resumes)",
                        other.peer, len(other.tags), "" if len(other.tags) == 1 else "s", now - other.heard_at)
            other.heard_at = now  # said once, while it closes
            other.writer.transport.abort()  # now: a TLS close would wait for the hung peer's answer

    async def _open_on_compute(self, conn: Connection, tag: int, message: OpenSession | OpenLevels) -> None:
        try:
            if getattr(message, "structured_kind", ""):  # built once, seconds: not on the compute thread
                with contextlib.suppress(Exception):  # a tokenizer it cannot read: _guide says so, drafting goes on
                    await asyncio.to_thread(ll_tokenizer, self.model.tokenizer, self.model.spec.vocab_size)
            await self.compute.run(self.levels.open if isinstance(message, OpenLevels) else self.table.open, tag,
                                   message)
        except KVBudgetExceeded as exc:
            conn.tags.discard(tag)
            conn.send(Error("capacity", str(exc), req=message.req))
            return
        except SpecctlError as exc:
            conn.tags.discard(tag)
            self._refuse(conn, Error("bad_request", str(exc), req=message.req))
            return
        except Exception as exc:  # noqa: BLE001
            conn.tags.discard(tag)
            conn.send(Error("internal", f"could not open a draft session: {exc}", req=message.req))
            return
        if isinstance(message, OpenLevels):
            conn.send(SessionOpened(message.req, tag))
            return
        # The prompt's KV in chunks, each a job of its own (other sessions draft between them);
        # the session's first Propose waits for it, as for an early answer's commit.
        self.commits[tag] = asyncio.current_task()
        conn.send(SessionOpened(message.req, tag))
        try:
            async with prefill_turn(self.prefill_gate, self.table.prompt_to_feed(tag), self.table.cache_salt(tag)):
                while True:
                    done, spent = await self.compute.run(timed, self.table.prefill_step, tag)
                    for listener in self.prefill_listeners:
                        listener(spent)
                    if done:
                        break
        except Exception:  # noqa: BLE001 - the first proposal's catch-up feeds what is missing
            log.exception("prefilling draft session %s failed", tag)
        finally:
            if self.commits.get(tag) is asyncio.current_task():
                del self.commits[tag]
