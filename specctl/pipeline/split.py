"""Which layers each pipeline stage holds, and where each stage listens: pure functions
of the command line, the same on every box."""

from __future__ import annotations

from dataclasses import dataclass

from specctl.config import repeated
from specctl.errors import ConfigError
from specctl.runtime.loop import parse_hostport


def balanced_split(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """[a, b) per stage, sizes differing by at most one; the earlier stages take the extra
    layers (the last stage also runs the LM head, the first the embedding lookup, which is cheap)."""
    if not 1 <= stages <= num_layers:
        raise ConfigError(f"cannot split {num_layers} layers into {stages} stages: every stage needs a layer")
    base, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for i in range(stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def parse_layers(text: str, num_layers: int) -> tuple[int, int]:
    """``a:b`` -> [a, b), inside the model's layers."""
    try:
        first, last = (int(part) for part in text.split(":"))
    except ValueError:
        raise ConfigError(f"--layers must be a:b (e.g. 0:14), got {text!r}") from None
    if not 0 <= first < last <= num_layers:
        raise ConfigError(f"--layers {text}: need 0 <= a < b <= {num_layers} (the model's layers)")
    return first, last


def parse_pipeline(pipeline: str | None, index: int, count: int) -> list[tuple[str, int]]:
    """``--pipeline H:P,...``: one address per stage, in order (checked before anything loads)."""
    addresses = [parse_hostport(part.strip()) for part in pipeline.split(",")] if pipeline else []
    if count > 1 and len(addresses) != count:
        raise ConfigError(f"--stage {index}/{count} needs --pipeline with {count} HOST:PORT addresses, one per stage "
                          f"in order (got {len(addresses)})")
    if (twice := repeated(addresses)) is not None:  # a stage would connect to itself, or two stages share a port
        raise ConfigError("--pipeline names %s:%d twice: each stage listens at its own address" % twice)
    return addresses


@dataclass(frozen=True, slots=True)
class StagePlan:
    index: int  # 1-based
    count: int
    layers: tuple[int, int]
    listen: tuple[str, int] | None  # stages 2..n: where the previous stage connects
    next: tuple[str, int] | None  # stages 1..n-1: the next stage

    @property
    def first(self) -> bool:
        return self.index == 1

    @property
    def last(self) -> bool:
        return self.index == self.count


def plan_stage(index: int, count: int, num_layers: int, pipeline: str | None, layers: str | None) -> StagePlan:
    """Stage ``index`` of ``count`` from ``--pipeline H:P,...`` (one address per stage, in
    order; the first is stage 1's own address for clients) and ``--layers``."""
    addresses = parse_pipeline(pipeline, index, count)
    span = parse_layers(layers, num_layers) if layers else balanced_split(num_layers, count)[index - 1]
    if index == 1 and span[0] != 0 or index == count and span[1] != num_layers:
        raise ConfigError(f"--layers {span[0]}:{span[1]}: stage 1 must start at layer 0 and stage {count} end at "
                          f"layer {num_layers} (the last stage holds the LM head)")
    return StagePlan(index, count, span,
                     addresses[index - 1] if index > 1 else None,
                     addresses[index] if index < count else None)
