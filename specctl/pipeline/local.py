"""A pipelined target inside one process (``specctl up --stages N``, tests, benchmarks):
stages 2..n as stage servers on loopback, each with its own compute thread (a stage stands
for a device of its own; stage 1 waits on the others from its thread), sharing the loaded
model's weights. The stages talk over TCP exactly as on separate boxes."""

from __future__ import annotations

import asyncio
import dataclasses

from specctl.engine.loader import LoadedModel
from specctl.engine.parts import decoder_part
from specctl.pipeline.decoder import PipelineClient
from specctl.pipeline.launch import pipelined_target
from specctl.pipeline.split import balanced_split
from specctl.pipeline.stage import StageServer, StageServerConfig


class LocalPipeline:
    def __init__(self, model: LoadedModel, stages: int, host: str = "127.0.0.1", delay_s: float = 0.0,
                 kv_budget_bytes: int | None = None) -> None:
        self.model, self.stages, self.host, self.delay_s = model, stages, host, delay_s
        self.kv_budget_bytes = kv_budget_bytes
        self.ranges = balanced_split(model.spec.num_layers, stages)
        self.servers: list[StageServer] = []  # stage 2 first
        self.ports: list[int] = []
        self.client: PipelineClient | None = None
        self.staged: LoadedModel | None = None  # stage 1 as a target model, once started
        self._link: asyncio.Task | None = None

    async def __aenter__(self) -> "LocalPipeline":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def stage_model(self, index: int) -> LoadedModel:
        part = decoder_part(self.model.decoder, self.ranges[index - 1], index == 1, index == self.stages)
        return dataclasses.replace(self.model, decoder=part)

    async def start(self) -> LoadedModel:
        """Start stages n..2, then link stage 1 to them; returns stage 1 as a target model."""
        next_port = None
        for index in range(self.stages, 1, -1):
            await self.start_stage(index, next_port)
            next_port = self.ports[0]
        target, self.client = pipelined_target(self.stage_model(1), (self.host, next_port), stages=self.stages,
                                               delay_s=self.delay_s)
        first = asyncio.get_running_loop().create_future()
        self._link = asyncio.create_task(self.client.run(first))
        if not await first:
            raise RuntimeError(f"local pipeline did not link: {self.client.last_error}")
        self.staged = target
        return target

    async def start_stage(self, index: int, next_port: int | None, port: int = 0) -> StageServer:
        config = StageServerConfig(host=self.host, port=port, index=index, count=self.stages,
                                   next_address=None if next_port is None else (self.host, next_port),
                                   delay_s=self.delay_s, kv_budget_bytes=self.kv_budget_bytes)
        server = StageServer(self.stage_model(index), config)
        bound = await server.start()
        self.servers.insert(0, server)
        self.ports.insert(0, bound)
        return server

    async def counters(self) -> list[tuple[float, int]]:
        """(busy seconds, forwards) of stages 2..n."""
        return [(server.stats.busy_s, server.stats.forwards) for server in self.servers]

    def snapshot(self) -> list[dict]:
        return [server.snapshot() for server in self.servers]

    async def close(self) -> None:
        if self._link is not None:
            self._link.cancel()
            await asyncio.gather(self._link, return_exceptions=True)
        for server in self.servers:
            await server.close()
