"""A request's choices: ``n`` per prompt, for each prompt of a batch, each its own generation
routed as any request is (gateway.routing: a choice follows its prompt's first to the instance
prefilling it, within the balance), all running at once; their events merged into one
stream in the order they arrive, each tagged with its choice's index (OpenAI's and vLLM's
layout: prompt i's j-th choice has index i * n + j).

A request is one unit: it starts once every choice has its first token (or, when the request
asked for return_progress, its first word of how far its prompt is read) or waits its turn for a
session (gateway.waiting), and one of them has started — so a choice that cannot start (a bad
prompt, no instance up, a full waiting line) fails the request with its HTTP error before any
response is sent, while a batch larger than the instances hold streams its first choices as
they come, as vLLM's queued ones do — and a choice that fails later (one that waited included)
ends them all. A choice whose instance is
lost mid-stream goes on from its output so far on another instance (Generate.resumed): the
client sees one unbroken output, the target's own, since what follows a text does not depend
on which instance computed it (a seeded sample's rest draws other numbers). Leaving the ``async with``
(the response done, or the client gone) cancels what still runs; each generation's stream
then cancels it on its target."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import AsyncIterator, NamedTuple

from specctl.engine.text import IncrementalText
from specctl.gateway import responses as R
from specctl.gateway.metrics import GatewayMetrics
from specctl.gateway.upstream import LOST, Upstream
from specctl.net.protocol import PromptProgress, Tokens
from specctl.spec.params import SamplingParams
from specctl.verify.client import RemoteError, TargetStream

log = logging.getLogger("specctl.gateway")


class Event(NamedTuple):
    """What a generation hands the response, as its tokens arrive."""
    delta: str  # text to hand out now
    finish: str | None  # the finish_reason, on the last event
    stats: dict  # the generation's statistics, on the last event
    count: int  # completion tokens so far
    logprobs: list  # R.TokenLogprob of this event's tokens (empty unless the request asked)
    prompt: list | None = None  # the prompt's R.TokenLogprob, on a choice's first event (when the request asked)
    # vLLM's stop_reason, on the last event: the stop string or stop token id that ended it (None: EOS, length)
    stop_reason: str | int | None = None
    tokens: tuple[int, ...] = ()  # this event's token ids (llama.cpp's streamed ``tokens``)
    stop_token: int | None = None  # the EOS or stop token that ended it, on the last event (SGLang's ``matched``)
    # llama.cpp's prompt_progress (total, cache, processed, time_ms) after a chunk of the prompt, when the
    # request asked (SamplingParams.prompt_progress): an event of its own, before the first token's
    prompt_progress: dict | None = None


@dataclass(frozen=True, slots=True)
class ChoiceSpec:
    index: int
    prompt: list[int]
    params: SamplingParams
    echo: str | None = None  # the prompt's text, handed out before the generation's (completions' echo)
    echo_only: bool = False  # echo with max_tokens 0: the prompt (and its scores) alone, the token generated left out


@dataclass(slots=True)
class Progress:
    """A choice's output so far, across the instances it ran on."""
    text: IncrementalText
    tokens: list[int] = field(default_factory=list)  # its output token ids handed on
    first_at: float | None = None  # when its first token came
    resumes: int = 0  # instances lost under it
    resumed_tokens: int = 0  # the output the last instance was handed to go on from

    def stats(self, stats: dict) -> dict:
        """An instance's stats of the choice, saying when they cover only what followed a resume."""
        return {**stats, "resumes": self.resumes, "resumed_tokens": self.resumed_tokens} if self.resumes else stats


def choice_specs(prompts: list[list[int]], params: list[SamplingParams], n: int,
                 echoes: list[str] | None = None, echo_only: bool = False) -> list[ChoiceSpec]:
    """Prompt i's j-th choice: index i * n + j; with a seed, seed + j (as vLLM seeds a request's
    choices: reproducible, and not n copies of one sample)."""
    return [ChoiceSpec(i * n + j, prompt,
                       p if p.seed is None or not j else dataclasses.replace(p, seed=nth_seed(p.seed, j)),
                       echoes[i] if echoes else None, echo_only)
            for i, (prompt, p) in enumerate(zip(prompts, params)) for j in range(n)]


def nth_seed(seed: int, j: int) -> int:
    """seed + j, wrapped around the 64-bit integers a seed is (the last seed's next is the first)."""
    return (seed + j + 2**63) % 2**64 - 2**63


class Choices:
    """Owns the tasks of one request's generations (``async with``: none outlives it)."""

    def __init__(self, upstream: Upstream, metrics: GatewayMetrics, tokenizer, specs: list[ChoiceSpec],
                 stop: list[str], include_stop: bool = False, arrival: float | None = None, priority: int = 0,
                 request_id: str = "", skip_special_tokens: bool = True, stop_regex: tuple = ()) -> None:
        self.upstream, self.metrics, self.tokenizer, self.specs, self.stop = upstream, metrics, tokenizer, specs, stop
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output
        self.arrival = time.perf_counter() if arrival is None else arrival  # the request's, for the latencies
        self.priority = priority  # its place among generations waiting for a session (gateway.waiting)
        self.request_id = request_id  # gateway.request_id: each generation goes as it, or "<id>-<index>" if several
        self.skip_special_tokens = skip_special_tokens  # vLLM's: special tokens left out of the text
        self.stop_regex = stop_regex  # SGLang's, compiled (engine.stop_regex)
        self._queue: asyncio.Queue[tuple[int, Event | BaseException]] = asyncio.Queue()
        self._counts: dict[int, int] = {}  # each choice's completion tokens handed on so far
        self._started: list[asyncio.Future] = []
        self._waiting: list[bool] = []  # each choice waiting its turn for a session
        self._moved = asyncio.Event()  # a choice started, waits or failed to start
        self._entered = False  # the request started: a choice's failure goes to the events
        self._tasks: list[asyncio.Task] = []
        self.finished = False  # every choice's last event handed on: the answer is whole, whoever reads it

    async def __aenter__(self) -> "Choices":
        loop = asyncio.get_running_loop()
        self._started = [loop.create_future() for _ in self.specs]
        self._waiting = [False] * len(self.specs)
        self._tasks = [asyncio.create_task(self._run(k, spec)) for k, spec in enumerate(self.specs)]
        try:
            await self._wait_started()
        except BaseException:
            await self._stop()
            raise
        self._entered = True
        return self

    def failed(self, exc: BaseException) -> None:
        """Entered after all, though it could not start (its stream opened while it waited,
        gateway.keepalive): ``events()`` raises ``exc``, which the reply sends in its shape."""
        self._entered = True
        self._queue.put_nowait((0, exc))

    async def __aexit__(self, *exc_info) -> None:
        await self._stop()

    async def _wait_started(self) -> None:
        """Until every choice started or waits its turn, one of them started (a request whose
        every choice waits keeps waiting: its timeout is a 503 still); the first choice that
        could not start fails the request."""
        while True:
            for future in self._started:
                if future.done():
                    future.result()
            started = [future.done() for future in self._started]
            if any(started) and all(s or waits for s, waits in zip(started, self._waiting)):
                return
            self._moved.clear()
            await self._moved.wait()

    def _waits(self, k: int) -> None:
        self._waiting[k] = True
        self._moved.set()

    async def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for future in self._started:  # retrieved, so that no "exception never retrieved" is logged
            if future.done() and not future.cancelled():
                future.exception()

    async def _run(self, k: int, spec: ChoiceSpec) -> None:
        started = self._started[k]
        progress = Progress(IncrementalText(self.tokenizer, self.stop, self.include_stop, self.skip_special_tokens,
                                            self.stop_regex))
        try:
            name = self.request_id if len(self.specs) == 1 else f"{self.request_id}-{spec.index}"
            while True:
                # a resumed generation: its prompt's scores (and how far it was read) went out with the
                # first instance's first events
                params = (dataclasses.replace(spec.params, prompt_logprobs=None, prompt_progress=False)
                          if progress.resumes else spec.params)
                try:
                    async with self.upstream.stream(spec.prompt, params, self.priority, name, tuple(progress.tokens),
                                                    partial(self._waits, k)) as (stream, first):
                        if not started.done():
                            started.set_result(None)
                            self._moved.set()
                        async for event in self._events(stream, first, spec, progress):
                            await self._queue.put((k, event))
                    return
                except RemoteError as exc:
                    if not started.done() or exc.code not in LOST or progress.resumes >= len(self.upstream.targets):
                        raise
                    lost = exc
                if len(progress.tokens) >= spec.params.max_tokens:  # all of it came, only its DONE was lost
                    await self._queue.put((k, self._last(progress, {}, "length", None, spec.params)))
                    return
                progress.resumes, progress.resumed_tokens = progress.resumes + 1, len(progress.tokens)
                self.metrics.resumed_generations.inc()
                log.warning("request %s: %s; going on from its %d tokens on another instance if one is up", name,
                            lost, len(progress.tokens))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the request, which ends with it
            if progress.resumes and not isinstance(exc, RemoteError):  # none could take it over
                cause = "no other instance is up" if getattr(exc, "status", None) == 503 else f"failed: {exc}"
                exc = RemoteError(lost.code, f"{lost}; going on from its {len(progress.tokens)} tokens: {cause}")
                log.warning("request %s: could not go on: %s", name, cause)
            if not (started.done() or self._entered):
                started.set_exception(exc)
                self._moved.set()
            else:
                await self._queue.put((k, exc))

    @property
    def completion_tokens(self) -> int:
        """Completion tokens of every choice handed on so far (all of them once events() ended)."""
        return sum(self._counts.values())

    def usage_of(self, index: int) -> tuple[int, int]:
        """(prompt tokens, completion tokens handed on so far) of the choice ``index``: a
        streamed chunk's usage under vLLM's continuous_usage_stats is its own choice's."""
        k = next(k for k, spec in enumerate(self.specs) if spec.index == index)
        return len(self.specs[k].prompt), self._counts.get(k, 0)

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """(choice index, event) until every choice has finished; a choice's failure is raised."""
        running = len(self.specs)
        while running:
            k, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            running -= item.finish is not None
            self._counts[k] = item.count
            self.finished = not running
            yield self.specs[k].index, item

    async def _events(self, stream: TargetStream, first, spec: ChoiceSpec, progress: Progress) -> AsyncIterator[Event]:
        """Text deltas (with their tokens' log-probabilities) as tokens arrive, the last with its
        finish_reason and the generation's stats; an echoed prompt first (on the first instance),
        after how far the prompt was read (when asked: PROMPT_PROGRESS until the first TOKENS)."""
        while isinstance(first, PromptProgress):
            yield Event("", None, {}, 0, [], prompt_progress={"total": first.total, "cache": first.cache,
                                                              "processed": first.processed, "time_ms": first.time_ms})
            first = await stream.next()
        if not progress.resumes:
            scored = (R.prompt_logprobs(spec.prompt, first) if spec.params.prompt_logprobs is not None
                      and isinstance(first, Tokens) else None)
            if spec.echo is not None:  # with logprobs, its tokens listed as the output's are
                yield Event(spec.echo, None, {}, 0, R.echoed(scored, spec.params.logprobs), scored)
            elif scored is not None:
                yield Event("", None, {}, 0, [], scored)
            if spec.echo_only:  # the prompt was all it asked for: the target's token is not wanted
                stats = progress.stats(await stream.cancel())
                self.metrics.record_generation(stats)
                yield Event("", "length", stats, 0, [])
                return
        text, event = progress.text, first
        while True:
            if isinstance(event, Tokens):
                if progress.first_at is None and event.tokens:
                    progress.first_at = time.perf_counter()
                progress.tokens += event.tokens
                self.metrics.generation_tokens.inc(len(event.tokens))
                delta = text.push(event.tokens)
                logprobs = [R.TokenLogprob(*entry) for entry in zip(event.tokens, event.logprobs, event.top_ids,
                                                                     event.top_logprobs, event.output_ranks())]
                tokens = tuple(event.tokens)
                if text.stopped:  # a round's tokens past the stop are not the output's (nor its count, logprobs)
                    kept = len(tokens) - (len(progress.tokens) - text.stop_tokens)
                    del progress.tokens[text.stop_tokens:]
                    tokens, logprobs = tokens[:kept], logprobs[:kept]
                count, first_at = len(progress.tokens), progress.first_at
                if text.stopped:  # the rest is not wanted: stop the target, keep its stats for the counters
                    stats = progress.stats(await stream.cancel())
                    self.metrics.record_generation(stats)
                    self.metrics.record_latency(self.arrival, first_at, time.perf_counter(), count)
                    yield Event(delta, "stop", stats, count, logprobs, stop_reason=text.matched, tokens=tokens)
                    return
                yield Event(delta, None, {}, count, logprobs, tokens=tokens)
            else:
                self.metrics.record_generation(event.stats)
                last = self._last(progress, progress.stats(event.stats), event.finish_reason, event.stop_token,
                                  spec.params)
                self.metrics.record_latency(self.arrival, progress.first_at, time.perf_counter(), last.count)
                yield last
                return
            event = await stream.next()

    def _last(self, progress: Progress, stats: dict, finish_reason: str | None, stop_token: int | None,
              params: SamplingParams) -> Event:
        """A choice's last event once its generation is done: the text's rest — cut at a stop
        its last, unfinished character held (the output ends there, as a stop)."""
        delta = progress.text.finish()
        if progress.text.stopped:
            del progress.tokens[progress.text.stop_tokens:]
            return Event(delta, "stop", stats, len(progress.tokens), [], stop_reason=progress.text.matched)
        return Event(delta, finish_reason, stats, len(progress.tokens), [],
                     stop_reason=self._stop_reason(stop_token, params), stop_token=stop_token)

    def _stop_reason(self, stop_token: int | None, params: SamplingParams) -> int | None:
        """The stop token id that ended an output, as vLLM reports it: one of the request's
        stop_token_ids (an infill's end tokens among them), None for the tokenizer's EOS."""
        if stop_token is None or stop_token == getattr(self.tokenizer, "eos_token_id", None):
            return None
        return stop_token if stop_token in params.stop_token_ids else None
