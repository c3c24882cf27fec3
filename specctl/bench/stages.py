"""A pipelined target for ``bench pipeline`` with stages 2..n as processes of their own
(``specctl verify --stage i/n``, the command a box per stage runs) and stage 1 in the
bench's process (it drafts and decides, as stage 1 does). Separate processes stand closer
to a device per stage than stage threads of one process: they share this machine's cores
but not one interpreter lock."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import time

from specctl.bench.processes import free_ports, spawn_role, stop_processes, wait_listening
from specctl.engine.loader import LoadedModel
from specctl.engine.parts import decoder_part
from specctl.errors import SpecctlError
from specctl.pipeline.decoder import PipelineClient
from specctl.pipeline.launch import pipelined_target
from specctl.pipeline.split import balanced_split

STATS_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True, slots=True)
class StageProcessSettings:
    model: str  # the name or path every stage process loads its layers of
    dtype: str = "fp32"
    delay_s: float = 0.0  # emulated extra time of every stage's forward
    threads: int = 1  # torch threads per stage process


class StageProcesses:
    """Stages 2..n as child processes; ``start()`` returns stage 1 as a target model."""

    def __init__(self, model: LoadedModel, stages: int, settings: StageProcessSettings,
                 host: str = "127.0.0.1") -> None:
        if stages < 2:
            raise ValueError("stage processes need a pipeline of 2 or more stages")
        self.model, self.stages, self.settings, self.host = model, stages, settings, host
        self.procs: list[subprocess.Popen] = []
        self.client: PipelineClient | None = None
        self._link: asyncio.Task | None = None

    async def start(self) -> LoadedModel:
        s = self.settings
        ports = free_ports(self.stages)
        pipeline = ",".join(f"{self.host}:{port}" for port in ports)
        try:
            for index in range(self.stages, 1, -1):
                # One at a time: loading several stages' weights at once can peak past this box's memory.
                proc = spawn_role("verify", "--stage", f"{index}/{self.stages}", "--pipeline", pipeline, "--model",
                                  s.model, "--dtype", s.dtype, "--quant", "none", "--threads", str(s.threads),
                                  "--stage-delay-ms", str(1e3 * s.delay_s), "--log-level", "warning",
                                  threads=s.threads)
                self.procs.append(proc)
                await asyncio.to_thread(wait_listening, proc, f"stage {index}/{self.stages}")
            first = balanced_split(self.model.spec.num_layers, self.stages)[0]
            stage_one = dataclasses.replace(self.model, decoder=decoder_part(self.model.decoder, first, True, False))
            target, self.client = pipelined_target(stage_one, (self.host, ports[1]), stages=self.stages,
                                                   delay_s=s.delay_s)
            linked = asyncio.get_running_loop().create_future()
            self._link = asyncio.create_task(self.client.run(linked))
            if not await linked:
                raise SpecctlError(f"the stage processes did not link: {self.client.last_error}")
        except BaseException:
            await self.close()
            raise
        return target

    async def counters(self) -> list[tuple[float, int]]:
        """(busy seconds, forwards) of stages 2..n, freshly asked of each stage."""
        assert self.client is not None
        self.client.stage_stats.clear()
        self.client.refresh_stats()
        deadline = time.monotonic() + STATS_TIMEOUT_S
        while len(self.client.stage_stats) < self.stages - 1:
            if time.monotonic() > deadline:
                raise SpecctlError(f"stage stats did not come back within {STATS_TIMEOUT_S:.0f}s")
            await asyncio.sleep(0.01)
        ordered = sorted(self.client.stage_stats.values(), key=lambda stats: int(str(stats["stage"]).split("/")[0]))
        return [(stats["step_ms"] * stats["forwards"] / 1e3, stats["forwards"]) for stats in ordered]

    async def close(self) -> None:
        if self._link is not None:
            self._link.cancel()
            await asyncio.gather(self._link, return_exceptions=True)
        await asyncio.to_thread(stop_processes, self.procs)
