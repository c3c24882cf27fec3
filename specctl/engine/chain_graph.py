"""A greedy draft chain's steps in one CUDA graph: after the catch-up forward gives x_1, the
draft feeds x_1 .. x_{s} one at a time, each step's argmax becoming the next step's input on
the device, so a proposal of d = s + 1 tokens costs one graph launch and one host read-back
instead of s launches and s read-backs. On an H100 the host's part of a step (building its
inputs, launching, reading back) was ~0.6 ms beside a 0.5B step's 1.3 ms of GPU time.

Each step is the session's bucket-1 static step (engine/static.py) with the same inputs, mask
and kernels, so the chain is the one the step-by-step path drafts, token for token. On the
CPU (tests) the same body runs eagerly."""

from __future__ import annotations

import torch

from specctl.engine.kv_cache import KVCache
from specctl.engine.static import StaticSegment


class ChainGraph:
    """``steps`` greedy steps of one session's cache: inputs (x_1, cache length) in a device
    buffer; outputs x_2..x_{steps+1}, their draft probabilities and each step's ranked
    candidates."""

    def __init__(self, decoder, cache: KVCache, steps: int, ranked: int, pool=None) -> None:
        device = decoder.device
        self.decoder, self.cache, self.steps, self.ranked = decoder, cache, steps, ranked
        pinned = device.type == "cuda"
        self.host = torch.zeros(1, dtype=torch.long, pin_memory=pinned)  # the cache's length
        self.length = torch.zeros(1, dtype=torch.long, device=device)
        self.first = torch.zeros(1, dtype=torch.long, device=device)
        self.sent = torch.cuda.Event() if pinned else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if pool is not None:
            self.length.fill_(cache.length)  # the warm-up writes only uncommitted slots
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._body()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
                self.outputs = self._body()

    def _body(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        spec, cache = self.decoder.spec, self.cache
        columns = torch.arange(cache.slots, device=self.length.device)
        token, tokens, likely, ranked = self.first, [], [], []
        for i in range(self.steps):
            at = self.length + i  # the fed token's position and cache slot
            mask = (columns <= at).unsqueeze(0)  # the bucket-1 step's causal row
            segment = StaticSegment(cache, at, mask.repeat(spec.num_heads // spec.num_kv_heads, 1))
            rows = self.decoder.static_forward(token, at, segment)
            token = rows[0].argmax().view(1)
            tokens.append(token)
            likely.append(rows[0].softmax(-1)[token])
            ranked.append(rows[0].topk(min(self.ranked, rows.shape[-1])).indices)
        return torch.cat(tokens), torch.cat(likely), torch.stack(ranked)

    def run(self, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feed x_1 (a device scalar, never read back here) and the drafted tokens after it;
        the cache then holds them all (``steps`` more positions)."""
        cache = self.cache
        cache.check_room(self.steps)
        if self.sent is not None:
            self.sent.synchronize()
        self.host[0] = cache.length
        self.length.copy_(self.host, non_blocking=True)
        if self.sent is not None:
            self.sent.record()
        self.first.copy_(first.view(1))
        if self.graph is not None:
            self.graph.replay()
            outputs = tuple(out.clone() for out in self.outputs)  # the next replay overwrites them
        else:
            outputs = self._body()
        cache.commit(self.steps)
        return outputs


def draft_chain(runner, cache: KVCache, first: torch.Tensor, steps: int, ranked: int):
    """``ChainGraph.run`` of the cache's chain graph of ``steps`` (captured on first use when
    the runner makes CUDA graphs; kept on the cache, freed with it)."""
    key = ("chain", steps, ranked)
    chain = cache.steps.get(key)
    if chain is None:
        chain = ChainGraph(runner.decoder, cache, steps, ranked, runner.pool)
        cache.steps[key] = chain
        runner.captures += chain.graph is not None
    runner.replays += chain.graph is not None
    return chain.run(first)
