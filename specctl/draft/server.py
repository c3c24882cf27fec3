"""The draft server: accepts target instances (one TCP connection each, many sessions
multiplexed by tag), puts every request into the compute thread's global buffer, and
sends replies through a per-connection outgoing queue so a slow target never blocks
another. Per-tag state is freed on CloseSession or when its connection drops."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
import logging
import time
from functools import partial

from specctl.draft.connection import Connection, DraftServerConfig
from specctl.draft.draft_stats import draft_snapshot
from specctl.draft.levels import LevelTable
from specctl.draft.opening import SessionOpening
from specctl.draft.sessions import SessionTable, UnknownTag
from specctl.draft.speculation import SpeculationCache
from specctl.engine.kv_cache import KVPool
from specctl.engine.loader import LoadedModel
from specctl.engine.prefill_gate import prefill_gate
from specctl.engine.prefix_cache import flush_prefix_cache
from specctl.engine.spec import check_token_ids
from specctl.errors import BadRequest, ConfigError, SpecctlError
from specctl.net.framing import read_message
from specctl.net.handshake import server_handshake
from specctl.net.protocol import (
    CacheFlushed, CloseSession, Error, FlushCache, Graft, NextLevel, OpenLevels, OpenSession, Propose, ProtocolError,
    Reroot, Stats, StatsRequest,
)
from specctl.runtime.compute import ComputeLane, ComputeThread
from specctl.runtime.listen import ListeningServer, MessageRate, peer_name
from specctl.runtime.omp_wait import spinning_next_to
from specctl.spec.drafters import Drafter
from specctl.spec.logit_rules import draft_guide

log = logging.getLogger("specctl.draft")


class DraftServer(SessionOpening, ListeningServer):
    def __init__(self, model: LoadedModel, drafter: Drafter, config: DraftServerConfig, ssl=None,
                 compute: ComputeLane | None = None) -> None:
        super().__init__()
        self.model, self.config, self.ssl = model, config, ssl
        # Its own compute thread, or a lane of the device's thread when roles share a process.
        self.compute = compute or ComputeThread("draft-compute", max_batch=config.max_batch).lane(owns_thread=True)
        spec = model.spec
        guide_of = partial(draft_guide, tokenizer=model.tokenizer, vocab_size=spec.vocab_size,
                           stop_ids=set(model.eos_token_ids), device=model.decoder.device)
        self.table = SessionTable(drafter, KVPool(config.kv_budget_bytes), spec.vocab_size, spec.max_position,
                                  guide_of=guide_of)
        self.levels = LevelTable(model.decoder, self.table.pool, spec.vocab_size, spec.max_position, guide_of)  # SpecPipe
        if config.prespec is not None:
            if drafter.name not in ("chain", "tree"):
                raise ConfigError(f"pre-speculation drafts with the draft model: it needs --mode chain or tree, "
                                  f"not {drafter.name}")
            self.table.speculation = SpeculationCache.for_drafter(config.prespec, drafter, self.compute.wake_background)
            self.compute.add_background(self.table.speculation.step)
        self.proposals_sent = 0
        self.proposal_bytes = 0
        self.connections: dict[int, Connection] = {}
        self.commits: dict[int, asyncio.Task] = {}  # early answers being made their session's KV, by tag
        self.prefill_gate = prefill_gate(model.decoder)  # sessions that start alike feed their start once
        # told the seconds of each prompt prefill job: where targets share this compute thread
        # (the one-process cluster) it held up their rounds too (spec.depth_tuning.DepthTuner.stalled)
        self.prefill_listeners: list[Callable[[float], None]] = []
        self._ids = itertools.count(1)
        self._tags = itertools.count(1)
        self.started = time.time()
        # --omp-wait auto left the workers spinning (bound to all interfaces, it could not tell
        # where its targets run): the first target from this host is told to the log
        self.spinning_for_remote_targets = False

    @property
    def active_sessions(self) -> int:
        return sum(len(c.tags) for c in self.connections.values())

    def snapshot(self) -> dict:
        return draft_snapshot(self)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._live.track(writer)
        peer = peer_name(writer)
        conn: Connection | None = None
        try:
            hello = await server_handshake(
                reader, writer, role="draft", model=self.model.name, fingerprint=self.model.vocab_fingerprint,
                max_sessions=self.config.max_sessions, auth_token=self.config.auth_token,
                accept_roles={"target": True, "monitor": False, "gateway": False},
            )
            conn = Connection(next(self._ids), peer, hello.role, writer)
            if self.spinning_for_remote_targets and hello.role == "target":
                if (warning := spinning_next_to(writer.get_extra_info("peername"))) is not None:
                    log.warning(warning)
                    self.spinning_for_remote_targets = False  # said once
            self.connections[conn.id] = conn
            async with asyncio.TaskGroup() as group:
                group.create_task(self._write_loop(conn.outgoing, writer))
                try:
                    await self._read_loop(conn, reader, group)
                finally:
                    conn.outgoing.put_nowait(None)
        except (SpecctlError, asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError) as exc:
            log.info("connection %s closed: %s", peer, exc)
        except Exception:  # noqa: BLE001 - one broken connection must not take the server down
            log.exception("connection %s failed", peer)
        finally:
            if conn is not None:
                self.connections.pop(conn.id, None)
                for tag in conn.tags:
                    self.compute.submit_nowait(self._close_tag, tag)
                conn.tags.clear()
            writer.close()

    async def _read_loop(self, conn: Connection, reader: asyncio.StreamReader, group: asyncio.TaskGroup) -> None:
        rate = MessageRate(self.config.max_messages_per_s)
        while True:
            try:
                message = await read_message(reader, self.config.max_frame_bytes)
            except ProtocolError as exc:
                self._refuse(conn, Error("protocol", str(exc)))  # then close: the stream can't be trusted
                return
            except asyncio.IncompleteReadError:
                return
            conn.heard_at = time.monotonic()
            if await rate.admit():
                self.throttled += 1
            if isinstance(message, StatsRequest):
                conn.send(Stats("draft", self.snapshot()))
            elif isinstance(message, FlushCache):
                group.create_task(self._flush(conn))
            elif conn.role != "target":
                self._refuse(conn, Error("forbidden", f"a {conn.role} connection may only request stats "
                                                      "or flush the prefix cache"))
            elif isinstance(message, (OpenSession, OpenLevels)):
                self._open(conn, message, group)
            elif isinstance(message, NextLevel):
                if self._known(conn, message.tag):
                    conn.inflight.add(message.tag)
                    group.create_task(self._next_level(conn, message))
            elif isinstance(message, (Reroot, Graft)):
                if self._known(conn, message.tag):  # in order with the session's next level request
                    self.compute.submit_nowait(self.levels.reroot if isinstance(message, Reroot) else self.levels.graft,
                                               message)
            elif isinstance(message, Propose):
                if self._known(conn, message.tag):
                    conn.inflight.add(message.tag)
                    group.create_task(self._propose(conn, message, group))
            elif isinstance(message, CloseSession):
                if message.tag in conn.tags:
                    conn.tags.discard(message.tag)
                    tail = self._closing_tail(conn, message)
                    self.compute.submit_nowait(self._close_tag, message.tag, tail)
                else:
                    self._refuse(conn, Error("unknown_tag", f"unknown session tag {message.tag}", tag=message.tag))
            else:
                self._refuse(conn, Error("unexpected", f"a draft server does not handle {type(message).__name__}"))

    def _closing_tail(self, conn: Connection, message: CloseSession) -> list[int]:
        """The closing session's last tokens, or none when they are not token ids (the session
        closes all the same: what is refused is only text to learn from)."""
        try:
            check_token_ids(message.tokens, self.model.spec.vocab_size, "a closing session's tokens")
        except BadRequest as exc:
            self._refuse(conn, Error("bad_request", f"{exc}; the session is closed without them", tag=message.tag))
            return []
        return message.tokens

    def _close_tag(self, tag: int, tail: list[int] = ()) -> None:
        self.table.close(tag, tail)
        self.levels.close(tag)

    def _known(self, conn: Connection, tag: int) -> bool:
        """A request (a proposal, a level) for an open session of this connection, with none in flight."""
        if tag not in conn.tags:
            self._refuse(conn, Error("unknown_tag", f"unknown session tag {tag}", tag=tag))
        elif tag in conn.inflight:
            self._refuse(conn, Error("busy", f"session {tag} already has a request in flight", tag=tag))
        else:
            return True
        return False

    async def _next_level(self, conn: Connection, message: NextLevel) -> None:
        work = self.compute.run(self.levels.next_level, message.tag, message.frontier)
        level = await self._answer(conn, message.tag, work, "drafting a level")
        if level is not None:
            conn.send(level)

    async def _answer(self, conn: Connection, tag: int, work: Awaitable, what: str):
        """A session's reply, or None after telling that peer why there is none."""
        try:
            return await work
        except UnknownTag:
            self._refuse(conn, Error("unknown_tag", f"unknown session tag {tag}", tag=tag))
        except SpecctlError as exc:
            self._refuse(conn, Error("bad_request", str(exc), tag=tag))
        except Exception as exc:  # noqa: BLE001 - report, keep serving the other sessions
            log.exception("%s for tag %s failed", what, tag)
            conn.send(Error("internal", f"{what} failed: {exc}", tag=tag))
        finally:
            conn.inflight.discard(tag)
        return None

    def _answer_early(self, conn: Connection, message: Propose, group: asyncio.TaskGroup) -> bool:
        """A hit answered from the branches the compute thread published, without waiting behind
        its background step (draft/early.py); its adoption is queued at once."""
        if self.table.speculation is None:
            return False
        try:
            early = self.table.early_answer(message.tag, message.path, message.tokens, message.max_depth)
        except Exception:  # noqa: BLE001 - the compute thread's path serves it instead
            log.exception("answering session %s early failed", message.tag)
            return False
        if early is None:
            return False
        reply, ticket = early
        done = self.compute.submit_batched("commit", self.table.commit_many, ticket)
        self.commits[message.tag] = group.create_task(self._committed(message.tag, done))
        conn.inflight.discard(message.tag)
        self.proposals_sent += 1
        self.proposal_bytes += conn.send(reply)
        return True

    async def _committed(self, tag: int, done: asyncio.Future) -> None:
        """Wait for an early answer's commit; a failed one closed the session's state, so its
        next request is refused as an unknown tag (the target then opens a new one)."""
        try:
            await done
        except UnknownTag:  # closed while its answer was out: nothing to keep
            pass
        except Exception:  # noqa: BLE001 - logged; that session alone is affected
            log.exception("making an early answer of session %s its KV failed", tag)
        finally:
            if self.commits.get(tag) is asyncio.current_task():
                del self.commits[tag]

    async def _flush(self, conn: Connection) -> None:
        # behind the closes already queued on the compute thread (each stores its session's text)
        conn.send(CacheFlushed("draft", *await self.compute.run(flush_prefix_cache, self.model.decoder)))

    def _refuse(self, conn: Connection, error: Error) -> None:
        """Answer a bad or inconsistent request with an error to that peer only."""
        self.reject(conn.peer, f"{error.code}: {error.message}")
        conn.send(error)

    async def _propose(self, conn: Connection, message: Propose, group: asyncio.TaskGroup) -> None:
        commit = self.commits.get(message.tag)
        if commit is not None:  # the session's last answer is still being made its KV
            await asyncio.wait([commit])
        if self._answer_early(conn, message, group):
            return

        async def draft():
            request = (message.tag, message.path, message.tokens)
            # A hit answers at once, whatever else misses; a session with nothing planned skips
            # the lookup (a stale answer is safe: drafting drops any plan it finds).
            if self.table.speculation is not None and message.tag in self.table.speculation.plans:
                proposal = await self.compute.run_batched("lookup", self.table.lookup_many, (*request, message.max_depth))
                if proposal is not None:
                    return proposal
            return await self.compute.run_batched("propose", self.table.propose_many, (*request, message.max_depth))

        proposal = await self._answer(conn, message.tag, draft(), "drafting")
        if proposal is not None:
            self.proposals_sent += 1
            self.proposal_bytes += conn.send(proposal)
