"""The round loop: propose -> verify -> accept, once for every way of running a session.

``run_session(session, speculator, lane, emit)`` serves ``specctl generate``, the target
instance (``specctl verify``) and the embedded cluster alike. What differs is plugged in:

- the *speculator* proposes (a drafter in this process, a draft server over TCP; pipeline
  stages and pre-speculation plug in here too) and owns the draft side's lifecycle;
- the *lane* runs compute (the device's compute thread, or inline for a caller with no
  event loop to keep responsive), batching the verification of sessions due together;
- *emit* gets every committed token batch with the round that produced it.

A speculator that cannot propose returns no proposal and a reason: the round verifies
the root alone (plain autoregressive decoding: slower, never different)."""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Protocol

from specctl.engine.kv_cache import KVPool
from specctl.engine.model import Decoder
from specctl.engine.prefill_gate import PrefillGate, prefill_turn
from specctl.engine.tree import PlainTree
from specctl.runtime.compute import timed
from specctl.spec.batched_verify import apply_many
from specctl.spec.decode import DecodeSession
from specctl.spec.draft_state import DraftState, draft_capacity, draft_many
from specctl.spec.drafters import Drafter, NoDrafter, Proposal
from specctl.spec.params import SamplingParams
from specctl.spec.stats import GenerationStats, RoundResult, counted_draft

Emit = Callable[[list[int], RoundResult | None], None]  # (tokens, None for the prefill's first token)


class Drafted(NamedTuple):
    proposal: Proposal | None  # None: verify the root alone this round
    draft_s: float
    fallback: str | None = None  # why there is no proposal although one was wanted
    predicted: bool = False  # drafted from the request's prediction (spec.prediction)
    by_load: bool = False  # a plain round because the instance is loaded past where speculation pays (spec.turns)


class Speculator(Protocol):
    max_nodes: int  # the largest proposal it may return (root included)

    def begin(self, session: DecodeSession) -> None:
        """The session exists and its prefill is about to run (open the draft side now, so it overlaps)."""

    async def propose(self, session: DecodeSession) -> Drafted:
        """The next proposal, given the last round's outcome in ``session.last_path`` /
        ``session.last_committed`` (or the prefill's first token). The speculators a wrapper
        may ask (spec.prediction, spec.turns) also take ``outcome`` (the rounds they sat out)
        and ``max_depth`` (0: their own depth)."""

    def close(self) -> None:
        """Free the draft side's state for this session (called once, however the session ends)."""


class Lane(Protocol):
    async def run(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    async def run_batched(self, key: str, fn: Callable[[list], list], item: Any) -> Any: ...

    def submit_nowait(self, fn: Callable[..., Any], *args: Any) -> None: ...


class InlineLane:
    """Compute in the caller's thread, at once: for the one-process ``generate``, which has
    no event loop to keep responsive (and torch runs small ops fastest in the main thread)."""

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    async def run_batched(self, key: str, fn: Callable[[list], list], item: Any) -> Any:
        result = fn([item])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def submit_nowait(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)


class LocalSpeculator:
    """A drafter in this process, run on the target's lane."""

    def __init__(self, drafter: Drafter, lane: Lane, pool: KVPool | None = None) -> None:
        self.drafter, self.lane, self.pool = drafter, lane, pool
        self.max_nodes = drafter.max_nodes
        self.state: DraftState | None = None
        self.session: DecodeSession | None = None

    def begin(self, session: DecodeSession) -> None:
        """The draft session is opened on the compute side at the first round; the session is
        kept so that its whole text reaches the draft at the end."""
        self.session = session

    async def propose(self, session: DecodeSession, outcome: tuple[list[int], list[int]] | None = None,
                      max_depth: int = 0) -> Drafted:
        """``outcome``: what to tell the draft about the rounds since its last proposal, instead
        of the last round's path and tokens (rounds another speculator proposed in);
        ``max_depth``: a chain or tree at most that deep (0: the drafter's own depth)."""
        started = time.perf_counter()
        proposal = await self.lane.run(self._draft, session, outcome, max_depth)
        return Drafted(proposal, time.perf_counter() - started)

    def _draft(self, session: DecodeSession, outcome: tuple[list[int], list[int]] | None = None,
               max_depth: int = 0) -> Proposal:
        opening = self.state is None
        if opening:  # the text grows by appending: its first prompt_len tokens are the prompt
            capacity = draft_capacity(session.prompt_len, session.params.max_tokens, self.max_nodes)
            self.state = DraftState(self.drafter.open(capacity, self.pool), session.params, session.generator,
                                    session.seq[: session.prompt_len], capacity, self.max_nodes,
                                    session.target.spec.vocab_size, reproducible=session.params.repeatable)
        if outcome is not None and not opening:
            self.state.session.rounds_between()
        self.state.advance(*(outcome or (session.last_path, session.last_committed)))
        if opening and session.rules is not None and hasattr(self.state.session, "guide"):
            # the draft follows the request's rules from here (the committed text is in the copy already)
            self.state.session.guide = session.rules.guide(self.state.session.decoder.device)
        self.state.cap_depth(max_depth)
        result = draft_many([self.state])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def close(self) -> None:
        if self.state is not None:
            # the last round's tokens, which no proposal followed (a drafter that learns from text keeps them)
            self.lane.submit_nowait(_finish, self.state, list(self.session.seq))
            self.state = None


def _finish(state: DraftState, text: list[int]) -> None:
    try:
        state.session.observe(text)
    finally:
        state.close()


async def run_session(session: DecodeSession, speculator: Speculator, lane: Lane, emit: Emit,
                      gate: PrefillGate | None = None, prefilled: Callable[[], None] | None = None) -> None:
    """Prefill, then rounds until the session finishes. However it ends (finished, failed,
    cancelled), the session's KV cache and its draft-side state are freed. ``gate``: the
    server's (engine.prefill_gate), so sessions that start alike prefill their start once;
    ``prefilled``: called after each chunk of the prompt (the last too, before its first token)."""
    started = time.perf_counter()
    speculator.begin(session)
    try:
        async with prefill_turn(gate, session.seq, session.cache.salt):
            # the prompt in chunks, each a job of its own: other sessions' rounds run between them
            while True:
                first, spent = await lane.run(timed, session.prefill_step)
                session.stats.prefill_compute_s += spent
                if prefilled is not None:
                    prefilled()
                if first is not None:
                    break
        session.stats.prefill_s = time.perf_counter() - started
        emit(first, None)
        while not session.finished:
            drafted = await speculator.propose(session)
            proposal = drafted.proposal or Proposal(PlainTree.root(session.seq[-1]))
            asked = time.perf_counter()
            # Rounds of sessions of this lane that are due together share one target forward.
            tokens = await lane.run_batched("verify", apply_many, (session, proposal))
            tree = proposal.tree
            depth, accepted = counted_draft(tree.max_depth, len(session.last_path), len(tokens))
            result = RoundResult(depth, len(tree) - 1, accepted, len(tokens), drafted.draft_s,
                                 time.perf_counter() - asked, drafted.fallback, drafted.predicted, drafted.by_load)
            session.stats.record(result)
            session.stats.wall_s = time.perf_counter() - started
            emit(tokens, result)
    finally:
        session.stats.wall_s = time.perf_counter() - started
        speculator.close()
        lane.submit_nowait(session.close)


def run_inline(coroutine) -> Any:
    """Run a coroutine that never suspends (an InlineLane round loop) without an event
    loop, so a synchronous caller can use it even inside a running loop (tests)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("an inline round loop awaited something outside the InlineLane")


def generate(target: Decoder, prompt: list[int], params: SamplingParams, drafter: Drafter | None = None,
             **options: Any) -> tuple[list[int], GenerationStats, str | None]:
    """Run a session to the end in this thread: (tokens, stats, finish_reason); ``options``:
    ``run_to_end``'s."""
    session = run_to_end(target, prompt, params, drafter, **options)
    return session.output, session.stats, session.finish_reason


def run_to_end(target: Decoder, prompt: list[int], params: SamplingParams, drafter: Drafter | None = None, *,
               eos_token_ids: tuple[int, ...] = (), max_context: int | None = None, pool: KVPool | None = None,
               draft_pool: KVPool | None = None, on_tokens: Emit | None = None,
               run_ahead: bool | None = None, tokenizer: Any = None,
               until: Callable[[], bool] | None = None, resumed: tuple[int, ...] = (),
               prefilled: Callable[[DecodeSession], None] | None = None) -> DecodeSession:
    """Run a session to the end in this thread and hand it back finished (its output, stats,
    finish_reason and, when ``params`` asked, logprobs and prompt_logprobs; its KV freed).
    ``run_ahead``: see ``DecodeSession`` (None: where ``decode.runs_ahead`` says);
    ``tokenizer``: the target's, needed for structured output; ``until``: asked after each
    emit, True ends the session with finish_reason "stop" (a stop string the caller found in
    the text); ``resumed``: output already sent (``DecodeSession``'s), which ``on_tokens`` is not given;
    ``prefilled``: given the session after each chunk of its prompt (run_session's)."""
    from specctl.spec.prediction import with_prediction

    lane = InlineLane()
    speculator = with_prediction(LocalSpeculator(drafter or NoDrafter(), lane, draft_pool), params)
    session = DecodeSession(target, prompt, params, eos_token_ids, max_context, pool, speculator.max_nodes,
                            run_ahead, tokenizer, resumed)

    def emit(tokens: list[int], result: RoundResult | None) -> None:
        if on_tokens is not None:
            on_tokens(tokens, result)
        if until is not None and not session.finished and until():
            session.finish_reason = "stop"

    run_inline(run_session(session, speculator, lane, emit,
                           prefilled=None if prefilled is None else lambda: prefilled(session)))
    return session
