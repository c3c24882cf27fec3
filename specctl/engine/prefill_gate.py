"""Sessions that start the same way at the same time share one prefill.

The prefix cache (engine.prefix_cache) stores a prompt when its prefill ends. A session that
starts while another with the same start is still being prefilled — a request's n choices, a
burst of chats over one long system prompt — found nothing cached, and with chunked prefill
the two prefills interleave chunk by chunk, so the shared start was computed once a session.
The gate makes such a session wait for the prefill in flight to end and then restore what it
stored, as vLLM's scheduler does when a request's prefix blocks are being computed by another.

A session waits only where it pays: when a prefill in flight shares at least half of what this
prompt would compute (what the cache does not hold already), at least ``min_reuse`` tokens, and
is of a prompt at most twice as long as this one (computing its own, interleaved with that one's
chunks, would take about as long); a prompt sharing a short start, or any start with a much
longer one in flight, computes its own. Waiting changes when a prefill runs, never what it
computes (a restored prefix is what a prefill computes, up to rounding: engine.prefix_cache),
and a prefill that fails or is cancelled lets its waiters go all the same. One gate per
prefix cache — servers over one model (an embedded cluster's instances) share it, so a
session waits for a prefill in flight on another instance too; a prefill registered from
another event loop is not waited for. Without a prefix cache there is none."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import weakref
from typing import AsyncIterator, Iterator

import numpy as np

from specctl.engine.prefix_cache import PrefixCache, common_prefix


class PrefillGate:
    """The prompts one decoder is prefilling now (event loop only)."""

    def __init__(self, prefixes: PrefixCache) -> None:
        self.prefixes = prefixes
        self._running: dict[int, tuple[np.ndarray, str, asyncio.Event, asyncio.AbstractEventLoop]] = {}
        self._keys = itertools.count()
        self.waits = 0  # prefills that waited for another (stats)

    def sharer(self, prompt: list[int], salt: str = "") -> asyncio.Event | None:
        """The end of the prefill in flight worth waiting for (see the module's doc) — one of the
        same salt (KVCache.salt): only its store would serve this one — or None: start now."""
        tokens = np.asarray(prompt[:-1], dtype=np.int64)
        best, best_len, loop = None, 0, asyncio.get_running_loop()
        for running, its_salt, done, owner in self._running.values():
            if len(running) > 2 * len(prompt) or owner is not loop or its_salt != salt:
                continue  # it would outlast this one's, even interleaved; or its KV is another salt's
            n = common_prefix(running, tokens)
            if n > best_len:
                best, best_len = done, n
        if best is None:  # nothing in flight shares its start: no need to ask the cache
            return None
        held = self.prefixes.held(prompt, salt)
        gain = best_len - held
        if gain < max(self.prefixes.min_reuse, (len(prompt) - held) / 2):
            return None
        return best

    async def wait_turn(self, prompt: list[int], salt: str = "") -> None:
        """Wait while a prefill in flight is worth waiting for; at once when none is (and then
        without suspending, so an inline round loop may call it)."""
        waited = False
        while (done := self.sharer(prompt, salt)) is not None:
            waited = True
            await done.wait()
        self.waits += waited

    @contextlib.asynccontextmanager
    async def turn(self, prompt: list[int], salt: str = "") -> AsyncIterator[None]:
        """``wait_turn``, then the prompt in flight until the block (its prefill) ends."""
        await self.wait_turn(prompt, salt)
        with self.prefilling(prompt, salt):
            yield

    @contextlib.contextmanager
    def prefilling(self, prompt: list[int], salt: str = "") -> Iterator[None]:
        """Registers the prompt as in flight until the block ends, however it ends."""
        key = next(self._keys)
        done = asyncio.Event()
        self._running[key] = (np.asarray(prompt, dtype=np.int64), salt, done, asyncio.get_running_loop())
        try:
            yield
        finally:
            del self._running[key]
            done.set()

    @property
    def in_flight(self) -> int:
        """Prefills registered now."""
        return len(self._running)


def prefill_turn(gate: PrefillGate | None, prompt: list[int] | None,
                 salt: str = "") -> contextlib.AbstractAsyncContextManager:
    """``gate.turn(prompt, salt)``, or nothing to wait for when there is no gate or no prompt to prefill."""
    return gate.turn(prompt, salt) if gate is not None and prompt is not None else contextlib.nullcontext()


_gates: weakref.WeakKeyDictionary[PrefixCache, PrefillGate] = weakref.WeakKeyDictionary()


def prefill_gate(decoder) -> PrefillGate | None:
    """The gate of ``decoder``'s prefix cache (one a cache, shared by the servers over it), or
    None when it keeps none."""
    prefixes = getattr(decoder, "prefix_cache", None)
    if prefixes is None:
        return None
    if prefixes not in _gates:
        _gates[prefixes] = PrefillGate(prefixes)
    return _gates[prefixes]
