"""Starting a pipeline stage from its command line: which layers it loads, and stage 1's
pipelined target (a LoadedModel whose decoder runs the other stages over the links)."""

from __future__ import annotations

import dataclasses
import ssl as ssl_module

from rich.console import Console

from specctl.config import Config
from specctl.engine.loader import LoadedModel
from specctl.pipeline.decoder import PipelineClient, PipelineDecoder
from specctl.pipeline.link import StageLink
from specctl.pipeline.split import StagePlan, plan_stage


def model_layers(name: str, console: Console | None = None) -> int:
    """The target's number of layers, read from its config only (no weights)."""
    from specctl.engine.families import read_text_config
    from specctl.spec.factory import resolve_model, split_model_name

    base, _ = split_model_name(name)
    return read_text_config(resolve_model(base, console)).num_hidden_layers


def stage_plan(config: Config, index: int, count: int, pipeline: str | None, layers: str | None,
               console: Console | None = None) -> StagePlan:
    return plan_stage(index, count, model_layers(config.target, console), pipeline, layers)


def load_stage(config: Config, plan: StagePlan, console: Console | None = None) -> LoadedModel:
    from specctl.spec.factory import load_named

    stage = None if plan.count == 1 else (plan.layers, plan.first, plan.last)
    return load_named(config.target, config, console, config.target_quant, stage=stage, target=True)


def pipelined_target(stage_one: LoadedModel, next_address: tuple[str, int], *, stages: int,
                     auth_token: str | None = None, ssl: ssl_module.SSLContext | None = None,
                     delay_s: float = 0.0) -> tuple[LoadedModel, PipelineClient]:
    """Stage 1 as a target model: its decoder sends each micro-batch down the chain. Run
    ``client.run()`` on the event loop to build (and rebuild) the chain."""
    host, port = next_address
    client = PipelineClient(lambda on_reply: StageLink(host, port, model=stage_one.name,
                                                       fingerprint=stage_one.vocab_fingerprint, on_reply=on_reply,
                                                       auth_token=auth_token, ssl=ssl,
                                                       layers=stage_one.decoder.layer_range))
    return dataclasses.replace(stage_one, decoder=PipelineDecoder(stage_one.decoder, client, stages, delay_s)), client
