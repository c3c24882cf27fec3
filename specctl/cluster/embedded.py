"""Every role in one process: a draft server, N target instances and a gateway, talking
over loopback TCP exactly as they do on separate machines (same code paths). Used by
``specctl up`` and by ``specctl chat`` when no gateway is given."""

from __future__ import annotations

import asyncio
import copy
import threading
from dataclasses import dataclass

from rich.console import Console

from specctl.config import Config
from specctl.draft.server import DraftServer, DraftServerConfig
from specctl.engine.loader import LoadedModel
from specctl.errors import ConfigError
from specctl.gateway.metrics import GatewayMetrics
from specctl.runtime.compute import ComputeThread
from specctl.gateway.chat_template import load_chat_template
from specctl.gateway.harmony import serving_parsers
from specctl.gateway.sampling_defaults import describe, sampling_defaults
from specctl.gateway.config import MAX_BODY_BYTES, GatewayConfig, check_serving, served_context
from specctl.gateway.server import Gateway
from specctl.gateway.upstream import Upstream
from specctl.pipeline.decoder import PipelineClient
from specctl.pipeline.local import LocalPipeline
from specctl.spec.factory import load_draft_models, load_pair, make_drafter, suffix_drafter
from specctl.verify.draft_client import DraftClient
from specctl.verify.server import TargetServer, TargetServerConfig

EMBEDDED_DRAFT_DEADLINE_S = 10.0  # several drafters in one process: see _start_multi


@dataclass(slots=True)
class ClusterConfig:
    targets: int = 1
    host: str = "127.0.0.1"
    gateway_port: int = 8000
    draft_port: int = 0  # 0 = any free port
    default_max_tokens: int = 256
    speculate: bool = True  # False: no draft server, the targets decode autoregressively (a baseline)
    stages: int = 1  # pipeline stages per target instance (each on loopback, with its own compute thread)
    responses_store: int = 256  # the gateway's stored Responses API answers (gateway.response_store)
    max_waiting: int = 1024  # generations that may wait for a free session (gateway.waiting)
    queue_timeout_s: float = 600.0  # how long each may wait
    served_model_names: tuple[str, ...] = ()  # the gateway's names for the target (default: its own)
    scheduling_policy: str = "fcfs"  # the gateway's waiting line: fcfs or priority
    allowed_origins: tuple[str, ...] = ()  # browser origins the gateway answers with CORS headers
    request_id_headers: bool = False  # every gateway answer carries X-Request-Id (vLLM's --enable-request-id-headers)
    log_requests: bool = False  # the gateway logs each generation request taken and ended (--enable-log-requests)
    reasoning_parser: str | None = None  # the gateway's chat answers' thinking apart (--reasoning-parser)
    tool_call_parser: str = "hermes"  # how the gateway reads tool calls back (--tool-call-parser)
    generation_config: str = "auto"  # where a request's missing sampling fields come from (--generation-config)
    chat_template: str | None = None  # the gateway's chat template in place of the tokenizer's (--chat-template)
    max_model_len: int | None = None  # the gateway's context below the model's (--max-model-len)
    max_body_bytes: int = MAX_BODY_BYTES  # the largest request body the gateway reads (--max-body-kb)

    def __post_init__(self) -> None:
        if not 1 <= self.targets <= 64:
            raise ValueError(f"targets must be in 1..64, got {self.targets}")
        if not 1 <= self.stages <= 64:
            raise ValueError(f"stages must be in 1..64, got {self.stages}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"the largest request body must be at least 1 KiB (--max-body-kb), "
                             f"got {self.max_body_bytes} bytes")
        check_serving(self.responses_store, self.served_model_names, self.scheduling_policy, self.max_waiting,
                      self.queue_timeout_s, self.reasoning_parser, self.tool_call_parser, self.generation_config,
                      self.chat_template)


class EmbeddedCluster:
    def __init__(self, config: Config, cluster: ClusterConfig, console: Console | None = None,
                 models: tuple[LoadedModel, LoadedModel | None] | None = None,
                 compute: ComputeThread | None = None) -> None:
        self.config, self.cluster, self.console = config, cluster, console or Console(stderr=True)
        self.models = models  # already loaded (benchmarks reuse them); else loaded by start()
        self._given_compute = compute  # the caller's (served from the main thread); else our own
        self.draft_server: DraftServer | None = None
        self.draft_servers: list[DraftServer] = []  # mode multi: one per model drafter
        self.targets: list[TargetServer] = []
        self.links: list[asyncio.Task] = []
        self.pipelines: list[LocalPipeline] = []
        self.gateway: Gateway | None = None
        self.compute: ComputeThread | None = None
        self.urls: dict[str, str | list[str]] = {}

    async def start(self) -> dict:
        host, c = self.cluster.host, self.cluster
        if c.speculate and self.config.mode not in ("chain", "tree", "multi"):
            raise ValueError("the embedded cluster runs a draft server: mode must be chain or tree (or multi)")
        # One compute thread for the device, a lane per role (DESIGN: one compute thread per device).
        self.compute = self._given_compute or ComputeThread("cpu-compute", max_batch=self.config.max_batch)
        self.compute.share_between_roles()  # its roles answer each other: their sessions kept in step
        # The models load on it too: a second thread that ran torch keeps an OpenMP pool alive,
        # and with more pool threads than cores every small op afterwards sleeps and wakes its
        # workers (measured: a 0.5B decode step 74.5 -> 100 ms after a load in a worker thread)
        target, draft = self.models or await self.compute.lane().run(load_pair, self.config, self.console)
        if c.speculate and self.config.mode == "multi":
            return await self._start_multi(target)
        draft_port = None
        if c.speculate:
            self.draft_server = DraftServer(draft, make_drafter(self.config, draft), DraftServerConfig(
                host=host, port=c.draft_port, max_sessions=self.config.max_sessions * c.targets,
                max_batch=self.config.max_batch, kv_budget_bytes=self.config.kv_budget_bytes),
                compute=self.compute.lane(max_batch=self.config.max_batch))
            draft_port = await self.draft_server.start()
        target_ports = []
        for _ in range(c.targets):
            client = None
            if c.speculate:
                client = DraftClient(host, draft_port, model=target.name, fingerprint=target.vocab_fingerprint)
                first = asyncio.get_running_loop().create_future()
                self.links.append(asyncio.create_task(client.run(first)))
                await first
            model, chain = await self._split(target)
            server = TargetServer(model, TargetServerConfig(host=host, port=0, max_sessions=self.config.max_sessions,
                                                            kv_budget_bytes=self.config.kv_budget_bytes,
                                                            max_batch=self.config.max_batch,
                                                            **self.config.load_plan), client,
                                  compute=self.compute.lane(max_batch=self.config.max_batch), pipeline=chain)
            target_ports.append(await server.start())
            self.targets.append(server)
        self._share_prefills()
        return await self._start_gateway(target, target_ports, [f"{host}:{draft_port}"] if draft_port else [])

    def _share_prefills(self) -> None:
        """Every role here runs on one compute thread: a draft server's prompt prefill holds up the
        targets' rounds as their own prefills do, so their auto depth tuners leave it out too."""
        tuners = [server.depth_tuner for server in self.targets if server.depth_tuner is not None]
        for draft in filter(None, [self.draft_server, *self.draft_servers]):
            draft.prefill_listeners.extend(tuner.stalled for tuner in tuners)

    async def _split(self, target: LoadedModel) -> tuple[LoadedModel, PipelineClient | None]:
        """A target instance's model: the whole target, or stage 1 of its own loopback pipeline."""
        if self.cluster.stages == 1:
            return target, None
        pipeline = LocalPipeline(target, self.cluster.stages, self.cluster.host,
                                 kv_budget_bytes=self.config.kv_budget_bytes)
        self.pipelines.append(pipeline)
        return await pipeline.start(), pipeline.client

    async def _start_gateway(self, target: LoadedModel, target_ports: list[int], drafts: list[str]) -> dict:
        host, c = self.cluster.host, self.cluster
        metrics = GatewayMetrics()
        upstream = Upstream([f"{host}:{p}" for p in target_ports], drafts, fingerprint=target.vocab_fingerprint,
                            metrics=metrics, max_waiting=c.max_waiting, queue_timeout_s=c.queue_timeout_s)
        defaults = sampling_defaults(target.path, c.generation_config)
        tokenizer = target.tokenizer
        if c.chat_template is not None:  # the gateway's own copy: the loaded model may serve others (benchmarks)
            tokenizer = copy.copy(tokenizer)
            tokenizer.chat_template = load_chat_template(c.chat_template)
        if defaults:
            self.console.print(f"[dim]{describe(defaults)}[/]", soft_wrap=True)
        try:
            context = served_context(target.spec.max_position, c.max_model_len)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.gateway = Gateway(GatewayConfig(model_name=target.name, context=context, host=host,
                                             port=c.gateway_port, default_max_tokens=c.default_max_tokens,
                                             max_body_bytes=c.max_body_bytes,
                                             responses_store=c.responses_store,
                                             served_model_names=c.served_model_names,
                                             scheduling_policy=c.scheduling_policy,
                                             allowed_origins=c.allowed_origins,
                                             request_id_headers=c.request_id_headers,
                                             log_requests=c.log_requests,
                                             **dict(zip(("reasoning_parser", "tool_call_parser"), serving_parsers(
                                                 target.spec.arch, c.reasoning_parser, c.tool_call_parser))),
                                             sampling_defaults=tuple(defaults.items())),
                               tokenizer, upstream, metrics)
        gateway_port = await self.gateway.start()
        self.urls = {"gateway": f"http://{host}:{gateway_port}", "draft": drafts[0] if drafts else None,
                     "drafts": drafts, "targets": [f"{host}:{p}" for p in target_ports],
                     "stages": [[f"{host}:{p}" for p in pipeline.ports] for pipeline in self.pipelines]}
        return self.urls

    async def _start_multi(self, target: LoadedModel) -> dict:
        """Several drafters: a draft server per model drafter, every target routing among them
        (and the local n-gram lookup when named) and fusing their chains."""
        from specctl.spec.drafters import ModelChainDrafter
        from specctl.verify.fused import Fusion

        host, config = self.cluster.host, self.config
        models = await self.compute.lane().run(load_draft_models, config, target, self.console)  # as load_pair
        draft_addresses = []
        for name, model in models.items():
            drafter = ModelChainDrafter(model.decoder, config.depth, config.draft_stop)
            server = DraftServer(model, drafter, DraftServerConfig(
                host=host, port=0, max_sessions=config.max_sessions * self.cluster.targets, max_batch=config.max_batch,
                kv_budget_bytes=config.kv_budget_bytes), compute=self.compute.lane(max_batch=config.max_batch))
            draft_addresses.append(f"{host}:{await server.start()}")
            self.draft_servers.append(server)
        target_ports = []
        for _ in range(self.cluster.targets):
            clients = {}
            for name, address in zip(models, draft_addresses):
                clients[name] = DraftClient(host, int(address.rsplit(":", 1)[1]), model=target.name,
                                            fingerprint=target.vocab_fingerprint)
                first = asyncio.get_running_loop().create_future()
                self.links.append(asyncio.create_task(clients[name].run(first)))
                await first
            # every role here shares one compute thread: a drafter's proposal queues behind the
            # target's rounds, and skipping it at a deadline frees nothing (its work still runs, and
            # its next proposal has more text to catch up on); the deadline is for a hung drafter only
            fusion = Fusion(clients, ngram_depth=config.depth if "ngram" in config.drafter_names else 0,
                            budget=2 * config.depth, deadline_s=EMBEDDED_DRAFT_DEADLINE_S,
                            suffix=suffix_drafter(config) if "suffix" in config.drafter_names else None)
            model, chain = await self._split(target)
            server = TargetServer(model, TargetServerConfig(host=host, port=0, max_sessions=config.max_sessions,
                                                            kv_budget_bytes=config.kv_budget_bytes,
                                                            max_batch=config.max_batch,
                                                            **config.load_plan), None,
                                  compute=self.compute.lane(max_batch=config.max_batch), pipeline=chain,
                                  fusion=fusion)
            target_ports.append(await server.start())
            self.targets.append(server)
        self._share_prefills()
        return await self._start_gateway(target, target_ports, draft_addresses)

    async def close(self) -> None:
        if self.gateway:
            await self.gateway.close()
        for link in self.links:
            link.cancel()
        await asyncio.gather(*self.links, return_exceptions=True)
        for server in self.targets:
            await server.close()
        for pipeline in self.pipelines:
            await pipeline.close()
        for server in [self.draft_server, *self.draft_servers]:
            if server is not None:
                await server.close()
        if self.compute is not None and self._given_compute is None:
            self.compute.stop()


class ClusterThread:
    """An EmbeddedCluster on its own event loop in a background thread, for a synchronous
    caller (the chat REPL, tests using the synchronous openai client)."""

    def __init__(self, config: Config, cluster: ClusterConfig, console: Console | None = None,
                 compute: ComputeThread | None = None) -> None:
        self.cluster = EmbeddedCluster(config, cluster, console, compute=compute)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="specctl-cluster", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())
        self.loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        try:
            await self.cluster.start()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of start()
            self._error = exc
            self._ready.set()
            await self.cluster.close()
            return
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await self.cluster.close()

    def start(self) -> dict:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self.cluster.urls

    def stop(self) -> None:
        if self._thread.is_alive() and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=30)
