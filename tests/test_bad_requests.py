"""Well-formed but inconsistent requests of every kind, sent to a live draft server and a
live target instance while real sessions run: each gets an error (to its own peer only),
nothing else is disturbed (the real sessions equal the target alone), no traceback is
logged and no state is left behind."""

import asyncio
import logging
import math
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specctl.draft.server import DraftServer, DraftServerConfig
from specctl.engine.loader import load_model
from specctl.net.framing import read_message, write_message
from specctl.net.handshake import client_handshake
from specctl.net.protocol import (
    Cancel, CloseSession, Generate, OpenSession, Propose, SessionOpened, StatsRequest,
)
from specctl.spec.drafters import ModelChainDrafter
from specctl.spec.rounds import generate
from specctl.spec.params import SamplingParams
from specctl.verify.client import remote_generate
from specctl.verify.draft_client import DraftClient
from specctl.verify.server import TargetServer, TargetServerConfig
from tests.conftest import poll_until

VOCAB = 320  # the tiny models'
REAL_PROMPTS = [[5, 9, 13, 2], [7, 8, 9, 10, 7, 8, 9], [42, 43, 44]]


class Star:
    """A draft server and a target instance on their own event loop thread."""

    def __init__(self, target, draft) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.target_model = target
        self.call(self._start(target, draft))

    async def _start(self, target, draft) -> None:
        self.draft = DraftServer(draft, ModelChainDrafter(draft.decoder, 3), DraftServerConfig(port=0))
        self.draft_port = await self.draft.start()
        self.client = DraftClient("127.0.0.1", self.draft_port, model=target.name, fingerprint=target.vocab_fingerprint)
        first = asyncio.get_running_loop().create_future()
        self.link = asyncio.create_task(self.client.run(first))
        assert await first
        self.target = TargetServer(target, TargetServerConfig(port=0), self.client)
        self.target_port = await self.target.start()

    def call(self, coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _stop(self) -> None:
        self.link.cancel()
        await self.target.close()
        await self.draft.close()

    def stop(self) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def star(tiny_dir):
    target = load_model("tiny-llama", tiny_dir["llama"], "fp32")
    draft = load_model("tiny-llama@2", tiny_dir["llama"], "fp32", num_layers=2)
    live = Star(target, draft)
    yield live
    live.stop()


class Tracebacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR:
            self.records.append(record)


token = st.integers(min_value=-3, max_value=VOCAB + 3)
tokens = st.lists(token, max_size=12)
odd_prompt = st.one_of(st.just([]), tokens, st.lists(st.integers(0, VOCAB - 1), min_size=500, max_size=520))
odd_float = st.sampled_from([-1.0, 0.0, 0.7, 1.5, 101.0, math.nan, math.inf])
odd_int = st.integers(min_value=-5, max_value=100_000)
path = st.lists(st.integers(min_value=-2, max_value=12), max_size=5)
odd_salt = st.sampled_from(["", "tenant", "x" * 2000])
odd_order = st.lists(st.sampled_from(["temperature", "top_k", "top_p", "min_p", "dry", ""]), max_size=5)

draft_messages = st.lists(st.one_of(
    st.builds(Propose, tag=st.sampled_from(["own", 0, -1, 10**9]), path=path, tokens=tokens),
    st.builds(OpenSession, req=odd_int, prompt=odd_prompt, temperature=odd_float, top_p=odd_float, top_k=odd_int,
              seed=st.integers(0, 10), max_tokens=odd_int, reproducible=st.booleans(), penalty_last_n=odd_int,
              repetition_penalty=odd_float, sampler_order=odd_order, cache_salt=odd_salt),
    st.builds(CloseSession, tag=st.sampled_from(["own", 0, -7, 10**9])),
    st.just(StatsRequest()),
    st.builds(Generate, req=odd_int, prompt=tokens),  # not a draft server's message
), min_size=1, max_size=8)

target_messages = st.lists(st.one_of(
    st.builds(Generate, req=st.integers(1, 4), prompt=odd_prompt, max_tokens=odd_int, temperature=odd_float,
              top_p=odd_float, top_k=odd_int, stop_token_ids=tokens, penalty_last_n=odd_int, seed=st.integers(0, 3),
              repetition_penalty=odd_float, sampler_order=odd_order, cache_salt=odd_salt, prediction=tokens),
    st.builds(Cancel, req=st.integers(-1, 6)),
    st.builds(Propose, tag=st.integers(0, 3), path=path, tokens=tokens),  # not a target's message
    st.just(StatsRequest()),
), min_size=1, max_size=6)


async def _send_and_drain(port: int, role: str, fingerprint: str, messages: list, open_own: bool) -> list:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    replies = []
    try:
        await client_handshake(reader, writer, role=role, fingerprint=fingerprint)
        own = 0
        if open_own:
            await write_message(writer, OpenSession(1, [1, 2, 3], max_tokens=16))
            opened = await asyncio.wait_for(read_message(reader), 10)
            assert isinstance(opened, SessionOpened)
            own = opened.tag
        for message in messages:
            if getattr(message, "tag", None) == "own":
                message = type(message)(**{**{f: getattr(message, f) for f in message.__struct_fields__}, "tag": own})
            await write_message(writer, message)
        while True:  # every reply until the peer goes quiet
            replies.append(await asyncio.wait_for(read_message(reader), 0.3))
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        return replies
    finally:
        writer.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(to_draft=draft_messages, to_target=target_messages, open_own=st.booleans())
def test_inconsistent_requests_get_errors_and_disturb_nothing(star, to_draft, to_target, open_own):
    watcher = Tracebacks()
    logging.getLogger("specctl").addHandler(watcher)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    try:
        real = [star.submit(remote_generate("127.0.0.1", star.target_port, p, params)) for p in REAL_PROMPTS]
        fingerprint = star.target_model.vocab_fingerprint
        star.call(_send_and_drain(star.draft_port, "target", fingerprint, to_draft, open_own))
        star.call(_send_and_drain(star.target_port, "client", fingerprint, to_target, False))
        for prompt, run in zip(REAL_PROMPTS, real):
            tokens, reason, _ = run.result(120)
            assert tokens == generate(star.target_model.decoder, prompt, params)[0] and reason == "length"
        poll_until(lambda: (len(star.draft.table.states), star.draft.table.pool.used_bytes, star.target.active,
                            star.target.pool.used_bytes), lambda state: state == (0, 0, 0, 0))
        assert watcher.records == [], [r.getMessage() for r in watcher.records]
    finally:
        logging.getLogger("specctl").removeHandler(watcher)


def test_rejections_are_counted_in_stats(star):
    before = star.draft.snapshot()["rejected_requests"]
    star.call(_send_and_drain(star.draft_port, "target", star.target_model.vocab_fingerprint,
                              [Propose(10**9, [], [1]), CloseSession(10**9)], False))
    assert star.draft.snapshot()["rejected_requests"] == before + 2
    before = star.target.snapshot()["rejected_requests"]
    star.call(_send_and_drain(star.target_port, "client", "", [Cancel(5), Generate(1, [])], False))
    assert star.target.snapshot()["rejected_requests"] == before + 2
