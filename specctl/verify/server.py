"""A target instance (stage 1/1): serves GENERATE requests from clients, runs each
session's decode loop (send outcome -> get proposal -> verify -> accept) with proposals
from the draft server, and streams tokens as soon as they are accepted. When the draft
server is unreachable a round verifies the root alone: plain autoregressive decoding,
slower, never different."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

from specctl.draft.sessions import check_token_ids
from specctl.engine.kv_cache import KVPool
from specctl.engine.loader import LoadedModel
from specctl.engine.tree import TokenTree
from specctl.errors import KVBudgetExceeded, SpecctlError
from specctl.net.framing import read_message
from specctl.net.handshake import server_handshake
from specctl.net.protocol import (
    Cancel, Done, Error, Generate, Proposal as ProposalMsg, ProtocolError, Stats, StatsRequest, Tokens,
    encode,
)
from specctl.runtime.compute import ComputeLane, ComputeThread
from specctl.runtime.listen import ListenConfig, ListeningServer, MessageRate
from specctl.runtime.tasks import TaskGroup
from specctl.spec.decode import DecodeSession, apply_many
from specctl.spec.drafters import Proposal
from specctl.spec.sampling import SamplingParams
from specctl.spec.stats import GenerationStats
from specctl.verify.draft_client import DraftClient

log = logging.getLogger("specctl.verify")
CLIENT_CANCEL = "cancelled by the client"  # the reason a CANCEL message gives the session task


@dataclass(slots=True)
class TargetServerConfig(ListenConfig):
    verify_delay_s: float = 0.0  # emulate a slower target (bench star), never in production
    max_proposal_nodes: int = 128  # larger proposals from a draft server are ignored (AR round)
    max_batch: int = 8  # most sessions verified together in one target forward

    def __post_init__(self) -> None:
        ListenConfig.__post_init__(self)
        if self.verify_delay_s < 0 or self.max_proposal_nodes < 1 or self.max_batch < 1:
            raise ValueError("verify_delay_s must be >= 0, max_proposal_nodes and max_batch >= 1")


def proposal_from_message(msg: ProposalMsg) -> Proposal:
    try:
        tree = TokenTree.from_parents(msg.tokens, msg.parents, msg.probs)
    except ValueError as exc:
        raise ProtocolError(f"bad proposal tree: {exc}") from None
    q = None if msg.draft_probs is None else msg.draft_probs.to_torch()
    if q is not None and q.shape[0] != len(tree) - 1:
        raise ProtocolError(f"draft_probs has {q.shape[0]} rows for a chain of {len(tree) - 1} tokens")
    return Proposal(tree, q)


@dataclass(slots=True)
class TargetTotals:
    sessions_done: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    ar_rounds: int = 0
    proposal_wait_s: float = 0.0  # awaiting the draft server's proposals: its queue, service and the network
    started: float = field(default_factory=time.perf_counter)


class TargetServer(ListeningServer):
    def __init__(self, model: LoadedModel, config: TargetServerConfig, draft: DraftClient | None, ssl=None,
                 compute: ComputeLane | None = None) -> None:
        super().__init__()
        self.model, self.config, self.draft, self.ssl = model, config, draft, ssl
        # Its own compute thread, or a lane of the device's thread when roles share a process.
        self.compute = compute or ComputeThread("target-compute", max_batch=config.max_batch).lane(owns_thread=True)
        self.pool = KVPool(config.kv_budget_bytes)
        self.active = 0
        self.totals = TargetTotals()

    def snapshot(self) -> dict:
        t = self.totals
        wall = max(time.perf_counter() - t.started, 1e-9)
        stats = {
            "model": self.model.name, "sessions": self.active, "sessions_done": t.sessions_done,
            "rounds": t.rounds, "R_p": round(t.rounds / wall, 3), "tokens": t.tokens,
            "drafted": t.drafted, "accepted": t.accepted,
            "tokens_per_s": round(t.tokens / wall, 3), "ar_rounds": t.ar_rounds,
            "proposal_wait_s": round(t.proposal_wait_s, 6),
            "acceptance_rate": round(t.accepted / t.drafted, 4) if t.drafted else 0.0,
            "mean_accepted_length": round(1 + t.accepted / t.rounds, 4) if t.rounds else 0.0,
            "kv_used_mb": round(self.pool.used_bytes / 2**20, 2),
            "draft_connected": bool(self.draft and self.draft.connected.is_set()),
            "draft_reconnects": self.draft.reconnects if self.draft else 0,
            "draft_address": f"{self.draft.host}:{self.draft.port}" if self.draft else None,
            "max_sessions": self.config.max_sessions, "throttled": self.throttled,
        }
        stats.update(self.compute.stats.snapshot(self.compute.queue_depth))
        return stats

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._live.track(writer)
        peer = str(writer.get_extra_info("peername"))
        outgoing: asyncio.Queue = asyncio.Queue()
        tasks: dict[int, asyncio.Task] = {}
        try:
            await server_handshake(
                reader, writer, role="target", model=self.model.name, fingerprint=self.model.vocab_fingerprint,
                max_sessions=self.config.max_sessions, auth_token=self.config.auth_token,
                accept_roles={"client": False, "gateway": False, "monitor": False},
            )
            async with TaskGroup() as group:
                group.create_task(self._write_loop(outgoing, writer))
                try:
                    await self._read_loop(reader, outgoing, tasks, group)
                finally:
                    for task in tasks.values():  # the client is gone: stop its sessions everywhere
                        task.cancel()
                    outgoing.put_nowait(None)
        except (SpecctlError, asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError) as exc:
            log.info("client %s closed: %s", peer, exc)
        except Exception:  # noqa: BLE001
            log.exception("client %s failed", peer)
        finally:
            writer.close()

    async def _read_loop(self, reader, outgoing: asyncio.Queue, tasks: dict, group: TaskGroup) -> None:
        send = lambda message: outgoing.put_nowait(encode(message))  # noqa: E731
        rate = MessageRate(self.config.max_messages_per_s)
        while True:
            try:
                message = await read_message(reader, self.config.max_frame_bytes)
            except ProtocolError as exc:
                send(Error("protocol", str(exc)))
                return
            except asyncio.IncompleteReadError:
                return
            if await rate.admit():
                self.throttled += 1
            if isinstance(message, Generate):
                if message.req in tasks:
                    send(Error("bad_request", f"request id {message.req} is already running", req=message.req))
                    continue
                task = group.create_task(self._run_session(message, send))
                tasks[message.req] = task
                task.add_done_callback(lambda _t, req=message.req: tasks.pop(req, None))
            elif isinstance(message, Cancel):
                task = tasks.get(message.req)
                if task is None:
                    send(Error("unknown_request", f"no running request {message.req}", req=message.req))
                else:
                    task.cancel(CLIENT_CANCEL)  # answered with DONE "cancelled" and the session's stats
            elif isinstance(message, StatsRequest):
                send(Stats("target", self.snapshot()))
            else:
                send(Error("unexpected", f"a target instance does not handle {type(message).__name__}"))

    async def _run_session(self, msg: Generate, send) -> None:
        try:
            params = SamplingParams(temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k,
                                    max_tokens=msg.max_tokens, seed=msg.seed, stop_token_ids=tuple(msg.stop_token_ids),
                                    ignore_eos=msg.ignore_eos)
            check_token_ids(msg.prompt, self.model.spec.vocab_size)
            check_token_ids(msg.stop_token_ids, self.model.spec.vocab_size)
            if self.active >= self.config.max_sessions:
                raise KVBudgetExceeded(f"target instance full: {self.config.max_sessions} sessions running; retry later")
            creating = asyncio.ensure_future(self.compute.run(
                DecodeSession, self.model.decoder, msg.prompt, params, None, self.model.eos_token_ids, None, self.pool,
                None, self.config.max_proposal_nodes,
            ))
            session = await asyncio.shield(creating)  # cancelled meanwhile: the session made is still closed
        except asyncio.CancelledError as exc:
            creating.add_done_callback(self._close_orphan)
            if exc.args == (CLIENT_CANCEL,):
                send(Done(msg.req, "cancelled", GenerationStats(prompt_tokens=len(msg.prompt)).to_dict()))
            raise
        except SpecctlError as exc:
            code = "capacity" if isinstance(exc, KVBudgetExceeded) else "bad_request"
            send(Error(code, str(exc), req=msg.req))
            return
        self.active += 1
        started = time.perf_counter()
        try:
            await self._decode(session, params, msg, send)
            self._finish(session, msg.req, session.finish_reason or "stop", started, send)
            self.totals.sessions_done += 1
        except asyncio.CancelledError as exc:
            if exc.args == (CLIENT_CANCEL,):  # not a dropped connection: the client waits for the stats
                self._finish(session, msg.req, "cancelled", started, send)
            raise
        except Exception as exc:  # noqa: BLE001 - the session ends with a clear error, the server carries on
            log.exception("session %s failed", msg.req)
            send(Error("internal", f"generation failed: {exc}", req=msg.req))
        finally:
            self._release(session)

    def _close_orphan(self, creating: asyncio.Future) -> None:
        """A session whose request was cancelled while its KV cache was being set up."""
        if not creating.cancelled() and creating.exception() is None:
            self.compute.submit_nowait(creating.result().close)

    def _finish(self, session: DecodeSession, req: int, reason: str, started: float, send) -> None:
        session.stats.wall_s = time.perf_counter() - started
        self._release(session)  # before DONE: a client that reads DONE finds the state freed
        send(Done(req, reason, session.stats.to_dict()))

    def _release(self, session: DecodeSession) -> None:
        """Free a session's KV cache here and its state on the draft server (once)."""
        if getattr(session, "released", False):
            return
        session.released = True
        self.active -= 1
        self.compute.submit_nowait(session.close)
        if self.draft is not None:
            self.draft.close(getattr(session, "draft_handle", None))

    async def _open_draft(self, session: DecodeSession, params: SamplingParams, msg: Generate):
        if self.draft is None or not self.draft.connected.is_set():
            return None
        seed = msg.seed if msg.seed is not None else random.getrandbits(62)
        return await self.draft.open(session.seq[:-1] if session.output else list(msg.prompt), temperature=params.temperature,
                                     top_p=params.top_p, top_k=params.top_k, seed=seed, max_tokens=params.max_tokens)

    async def _decode(self, session: DecodeSession, params: SamplingParams, msg: Generate, send):
        opening = asyncio.ensure_future(self._open_draft(session, params, msg))  # overlaps the target's prefill
        try:
            first = await self.compute.run(session.prefill)
        finally:
            # Known to the session even when cancelled during the prefill, so _release closes it.
            session.draft_handle = handle = await opening
        self._emit(msg.req, first, send)
        fresh = True  # the draft has the prompt but not the committed tokens since
        # A draft server that refused this session (capacity, StarSD admission) is asked again
        # only after it reconnects: the session goes on autoregressively meanwhile.
        refused_epoch = self.draft.epoch if handle is None and self.draft is not None and self.draft.connected.is_set() else None
        while not session.finished:
            proposal = None
            if (handle is None and self.draft is not None and self.draft.connected.is_set()
                    and refused_epoch != self.draft.epoch):
                handle = session.draft_handle = await self._open_draft(session, params, msg)
                refused_epoch = self.draft.epoch if handle is None else None
                fresh = True
            if handle is not None:
                asked = time.perf_counter()
                if fresh:
                    reply = await self.draft.propose(handle, [], [session.seq[-1]] if session.output else [])
                else:
                    reply = await self.draft.propose(handle, session.last_path, session.last_committed)
                fresh = False
                self.totals.proposal_wait_s += time.perf_counter() - asked
                if reply is None:
                    handle = session.draft_handle = None
                else:
                    proposal = self._checked(reply, session)
            if proposal is None:
                proposal = Proposal(TokenTree.root(session.seq[-1]))
                self.totals.ar_rounds += 1
            if self.config.verify_delay_s:
                await asyncio.sleep(self.config.verify_delay_s)
            # Rounds of this instance's sessions that are due together share one forward.
            emitted = await self.compute.run_batched("verify", apply_many, (session, proposal))
            if len(proposal.tree) > 1:
                self.totals.rounds += 1
                self.totals.drafted += proposal.tree.max_depth
                self.totals.accepted += len(session.last_path)
            self._emit(msg.req, emitted, send)
        return handle

    def _checked(self, reply: ProposalMsg, session: DecodeSession) -> Proposal | None:
        """A proposal that does not fit this session is dropped: the round runs autoregressively."""
        try:
            proposal = proposal_from_message(reply)
        except ProtocolError as exc:
            log.warning("ignoring a bad proposal: %s", exc)
            return None
        vocab = self.model.spec.vocab_size
        if (len(proposal.tree) > session.max_nodes or int(proposal.tree.tokens[0]) != session.seq[-1]
                or int(proposal.tree.tokens.max()) >= vocab or int(proposal.tree.tokens.min()) < 0
                or (proposal.draft_probs is not None and proposal.draft_probs.shape[-1] != vocab)):
            log.warning("ignoring a proposal that does not fit the session")
            return None
        return proposal

    def _emit(self, req: int, tokens: list[int], send) -> None:
        if tokens:
            self.totals.tokens += len(tokens)
            send(Tokens(req, tokens))
