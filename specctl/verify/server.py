"""A target instance (stage 1/1): serves GENERATE requests from clients, runs each
session's decode loop (send outcome -> get proposal -> verify -> accept) with proposals
from the draft server, and streams tokens as soon as they are accepted. When the draft
server is unreachable a round verifies the root alone: plain autoregressive decoding,
slower, never different."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from specctl.engine.kv_cache import KVPool
from specctl.engine.loader import LoadedModel
from specctl.engine.prefill_gate import prefill_gate
from specctl.engine.prefix_cache import flush_prefix_cache
from specctl.engine.spec import check_token_ids
from specctl.spec.logit_rules import check_rule_token_ids
from specctl.errors import BadRequest, InvalidSamplingParams, KVBudgetExceeded, SpecctlError, StageUnavailable
from specctl.net.framing import read_message
from specctl.net.handshake import server_handshake
from specctl.net.protocol import (
    CacheFlushed, Cancel, Done, Error, FlushCache, Generate, ProtocolError, Stats, StatsRequest, Tokens, encode,
)
from specctl.pipeline.decoder import PipelineClient
from specctl.pipeline.microbatch import MicroBatchLane
from specctl.pipeline.serve import SpecPipeDraft, serve_specpipe
from specctl.runtime.compute import ComputeLane, ComputeThread
from specctl.runtime.emulation import SlowedLane
from specctl.runtime.listen import ListeningServer, MessageRate, peer_name
from specctl.spec.decode import DecodeSession
from specctl.spec.depth_tuning import DepthTuner
from specctl.spec.logprobs import emitted_logprobs
from specctl.spec.prediction import PREDICTION_NODES, with_prediction
from specctl.spec.rounds import Speculator, run_session
from specctl.spec.turns import LoadHold, SpeculationByLoad, depth_for_load
from specctl.spec.stats import GenerationStats, RoundResult
from specctl.spec.structured import ll_tokenizer
from specctl.verify.config import TargetServerConfig
from specctl.verify.draft_client import DraftClient
from specctl.verify.prefills import Prefills
from specctl.verify.fused import Fusion
from specctl.verify.speculator import RemoteSpeculator
from specctl.verify.target_stats import target_snapshot
from specctl.verify.wire_params import sampling_params_of

log = logging.getLogger("specctl.verify")
CLIENT_CANCEL = "cancelled by the client"  # the reason a CANCEL message gives the session task
ENDED_KEPT = 256  # a connection's ended request ids remembered, for a CANCEL that crossed a DONE


class TargetServer(ListeningServer):
    def __init__(self, model: LoadedModel, config: TargetServerConfig, draft: DraftClient | None, ssl=None,
                 compute: ComputeLane | None = None, pipeline: PipelineClient | None = None,
                 specpipe: SpecPipeDraft | None = None, fusion: Fusion | None = None) -> None:
        super().__init__()
        self.model, self.config, self.draft, self.ssl = model, config, draft, ssl
        self.fusion = fusion  # several drafters, routed and fused per session (instead of ``draft``)
        self.pipeline = pipeline  # stage 1 of a pipelined target: the link down the chain
        self.specpipe = specpipe  # SpecPipe (its draft here or on the draft server), instead of the round loop
        # A session's KV holds its largest proposal; under SpecPipe (stage 1 of a pipeline) its
        # whole tree in flight, a refill's levels included.
        # Without any draft every round is the root alone: one node (and sessions on CUDA
        # graphs then run ahead, see spec.decode.runs_ahead).
        self.session_nodes = (specpipe.max_nodes(model.decoder.stages) if specpipe is not None
                              else 1 if draft is None and fusion is None else config.max_proposal_nodes)
        # Its own compute thread, or a lane of the device's thread when roles share a process.
        self.compute = compute or ComputeThread("target-compute", max_batch=config.max_batch).lane(owns_thread=True)
        # Verification waits before it runs when emulating a slower target (bench star).
        slowed = config.verify_delay_s or config.verify_floor_s
        self.verify_lane = (SlowedLane(self.compute, config.verify_delay_s, config.verify_floor_s) if slowed
                            else self.compute)
        if pipeline is not None:  # several sessions' micro-batches in flight through the stages at once
            self.verify_lane = MicroBatchLane(self.verify_lane)
        self.pool = KVPool(config.kv_budget_bytes)
        self.prefill_gate = prefill_gate(model.decoder)  # sessions that start alike prefill their start once
        self.active = 0
        self.prefills = Prefills()  # the prompts being read (stats; PROMPT_PROGRESS where asked)
        self.load_hold = LoadHold(config.spec_max_sessions) if config.spec_max_sessions else None
        self.depth_tuner = DepthTuner(lambda: self.active) if config.spec_depth_auto else None
        self.sessions_done = 0
        self.totals = GenerationStats()  # every round of every session, one recorder
        self.started = time.perf_counter()

    def snapshot(self) -> dict:
        return target_snapshot(self)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._live.track(writer)
        peer = peer_name(writer)
        outgoing: asyncio.Queue = asyncio.Queue()
        tasks: dict[int, asyncio.Task] = {}
        try:
            await server_handshake(
                reader, writer, role="target", model=self.model.name, fingerprint=self.model.vocab_fingerprint,
                max_sessions=self.config.max_sessions, auth_token=self.config.auth_token,
                accept_roles={"client": False, "gateway": False, "monitor": False},
            )
            async with asyncio.TaskGroup() as group:
                group.create_task(self._write_loop(outgoing, writer))
                try:
                    await self._read_loop(reader, outgoing, tasks, group, peer)
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

    async def _read_loop(self, reader, outgoing: asyncio.Queue, tasks: dict, group: asyncio.TaskGroup, peer: str) -> None:
        send = lambda message: outgoing.put_nowait(encode(message))  # noqa: E731

        def refuse(error: Error) -> None:
            self.reject(peer, f"{error.code}: {error.message}")
            send(error)

        rate = MessageRate(self.config.max_messages_per_s)
        # requests of this connection that ended lately: a CANCEL for one crossed its DONE (a
        # stop string found as the generation ended), which is no fault to count or log
        ended: deque[int] = deque(maxlen=ENDED_KEPT)

        def forget(req: int) -> None:
            tasks.pop(req, None)
            ended.append(req)

        while True:
            try:
                message = await read_message(reader, self.config.max_frame_bytes)
            except ProtocolError as exc:
                refuse(Error("protocol", str(exc)))
                return
            except asyncio.IncompleteReadError:
                return
            if await rate.admit():
                self.throttled += 1
            if isinstance(message, Generate):
                if message.req in tasks:
                    refuse(Error("bad_request", f"request id {message.req} is already running", req=message.req))
                    continue
                task = group.create_task(self._run_session(message, send))
                tasks[message.req] = task
                task.add_done_callback(lambda _t, req=message.req: forget(req))
            elif isinstance(message, Cancel):
                task = tasks.get(message.req)
                if task is None:
                    error = Error("unknown_request", f"no running request {message.req}", req=message.req)
                    if message.req in ended:
                        send(error)
                    else:
                        refuse(error)
                else:
                    task.cancel(CLIENT_CANCEL)  # answered with DONE "cancelled" and the session's stats
            elif isinstance(message, StatsRequest):
                send(Stats("target", self.snapshot()))
            elif isinstance(message, FlushCache):
                group.create_task(self._flush(send))
            else:
                refuse(Error("unexpected", f"a target instance does not handle {type(message).__name__}"))

    async def _flush(self, send) -> None:
        # On the compute thread, behind the session closes already queued: a session answered
        # DONE stores its text there, so a flush sent after a reply leaves none of it behind.
        send(CacheFlushed("target", *await self.compute.run(flush_prefix_cache, self.model.decoder)))

    async def _run_session(self, msg: Generate, send) -> None:
        self.active += 1  # taken before any await: two requests cannot both see the last free slot
        try:
            session = await self._create(msg, send)
            if session is None:
                return
            emit = lambda tokens, result, scores=None: self._emit(session, msg.req, tokens, result, send,  # noqa: E731
                                                                 scores)
            try:
                prefilled = self.prefills.watch(session, msg.req, send if msg.return_progress else None)
                if self.specpipe is not None:  # a request's prediction grafted onto its tree (pipeline.predicted)
                    await serve_specpipe(session, self.specpipe, self.compute, emit, prefilled)
                else:
                    speculator = with_prediction(self._speculator(msg.seed, session.params), session.params)
                    await run_session(session, speculator, self.verify_lane, emit, self.prefill_gate, prefilled)
                self.sessions_done += 1
                self._done(session, msg.req, session.finish_reason or "stop", send)
            except asyncio.CancelledError as exc:
                if exc.args == (CLIENT_CANCEL,):  # not a dropped connection: the client waits for the stats
                    self._done(session, msg.req, "cancelled", send)
                raise
            except StageUnavailable as exc:  # a pipeline stage went away: this session cannot go on
                log.warning("session %s ended: %s", msg.request_id or msg.req, exc)
                send(Error("unavailable", f"generation failed: {exc}", req=msg.req))
            except (BadRequest, InvalidSamplingParams) as exc:  # what the request asked cannot go on: its error
                log.warning("session %s ended: %s", msg.request_id or msg.req, exc)
                send(Error("bad_request", f"generation failed: {exc}", req=msg.req))
            except Exception as exc:  # noqa: BLE001 - the session ends with a clear error, the server carries on
                log.exception("session %s failed", msg.request_id or msg.req)
                send(Error("internal", f"generation failed: {exc}", req=msg.req))
            finally:
                self.prefills.done(session)
        finally:
            self.active -= 1

    async def _create(self, msg: Generate, send) -> DecodeSession | None:
        """The session's target state, made on the compute thread; None when refused (answered)."""
        creating = None
        try:
            params = sampling_params_of(msg)
            check_rule_token_ids(params, self.model.spec.vocab_size)
            check_token_ids(msg.prompt, self.model.spec.vocab_size, "prompt token ids")
            check_token_ids(msg.stop_token_ids, self.model.spec.vocab_size, "stop_token_ids")
            check_token_ids(msg.prediction, self.model.spec.vocab_size, "prediction token ids")
            check_token_ids(msg.resumed, self.model.spec.vocab_size, "resumed output token ids")
            if self.active > self.config.max_sessions:
                raise KVBudgetExceeded(f"target instance full: {self.config.max_sessions} sessions running; retry later")
            if params.structured is not None:  # built once, seconds: not on the compute thread other sessions use
                await asyncio.to_thread(ll_tokenizer, self.model.tokenizer, self.model.spec.vocab_size)
            creating = asyncio.ensure_future(self.compute.run(
                DecodeSession, self.model.decoder, msg.prompt, params, self.model.eos_token_ids, None, self.pool,
                self._session_nodes(params), None, self.model.tokenizer, msg.resumed,
            ))
            return await asyncio.shield(creating)  # cancelled meanwhile: the session made is still closed
        except asyncio.CancelledError as exc:
            if creating is not None:
                creating.add_done_callback(self._close_orphan)
            if exc.args == (CLIENT_CANCEL,):
                send(Done(msg.req, "cancelled", GenerationStats(prompt_tokens=len(msg.prompt)).to_dict()))
            raise
        except SpecctlError as exc:
            if isinstance(exc, KVBudgetExceeded):
                send(Error("capacity", str(exc), req=msg.req))
            elif isinstance(exc, StageUnavailable):
                send(Error("unavailable", str(exc), req=msg.req))
            else:
                self.reject(f"request {msg.req}", f"bad_request: {exc}")
                send(Error("bad_request", str(exc), req=msg.req))
            return None

    def _speculator(self, seed: int | None, params) -> Speculator:
        """A round-loop session's drafter: the fused drafters or the draft server (none
        connected: AR rounds), planned by the instance's load (plain rounds past
        spec_max_sessions, shorter proposals by spec_depth_by_load, fixed or learnt) — unless a
        seed asks for the same text whatever the load (a plain round or a shorter chain draws
        other random numbers)."""
        if self.fusion is not None:
            speculator = self.fusion.speculator(seed)
        else:
            speculator = RemoteSpeculator(self.draft, self.config.max_proposal_nodes, seed)
        if (self.load_hold is None and not self.config.spec_depth_by_load and self.depth_tuner is None) \
                or params.repeatable:
            return speculator
        return SpeculationByLoad(speculator, self._round_plan, self.depth_tuner)

    def _round_plan(self) -> int | None:
        """A round by the instance's load: None, plain; else the deepest proposal (0: any)."""
        if self.load_hold is not None and self.load_hold(self.active):
            return None
        return depth_for_load(self.active, self.config.spec_depth_by_load)

    def _session_nodes(self, params) -> int:
        """The largest proposal a session verifies (SpecPipe: the tree nodes it keeps cached): a
        request's prediction is drafted from here (spec.prediction) even with no draft server;
        under SpecPipe its chains are grafted onto the tree (pipeline.predicted)."""
        if self.specpipe is not None:
            return self.specpipe.max_nodes(self.model.decoder.stages, bool(params.prediction))
        return max(self.session_nodes, PREDICTION_NODES) if params.prediction else self.session_nodes

    def _close_orphan(self, creating: asyncio.Future) -> None:
        """A session whose request was cancelled while its KV cache was being set up."""
        if not creating.cancelled() and creating.exception() is None:
            self.compute.submit_nowait(creating.result().close)

    def _done(self, session: DecodeSession, req: int, reason: str, send) -> None:
        # The round loop has set wall_s and queued the freeing of the session's state.
        send(Done(req, reason, session.stats.to_dict(), session.stop_token))

    def _emit(self, session: DecodeSession, req: int, tokens: list[int], result: RoundResult | None, send,
              scores: list | None = None) -> None:
        """Send the tokens just emitted; ``scores``: their log-probability entries when taken as
        they were emitted (SpecPipe's driver goes on meanwhile), else the session's last ones."""
        if result is not None:
            self.totals.record(result)
        prompt = session.prompt_logprobs if result is None else None  # the prefill's: the prompt's go with it
        if not tokens and prompt is None:
            return
        self.totals.new_tokens += len(tokens)
        own = scores if scores is not None else emitted_logprobs(session, len(tokens))
        logprobs, top_ids, top_logprobs, ranks = _columns(own, 4)
        send(Tokens(req, tokens, logprobs, top_ids, top_logprobs, *_columns(prompt or [], 4), ranks=ranks))


def _columns(entries: list, width: int) -> tuple[list, ...]:
    """(log-probability, alternatives' ids, theirs[, rank]) entries as the wire's parallel lists."""
    return tuple(map(list, zip(*entries))) if entries else ([],) * width
