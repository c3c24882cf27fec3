"""``specctl bench pipeline``: a target split over 1..n stages (real compute of each stage's
layers; stages 2..n as processes of their own on loopback TCP, each with an emulated
per-stage time standing for a device of its own) decoding with plain pipeline parallelism
(one token per traversal), pipeline + chain speculation (the whole proposal as one
micro-batch) and SpecPipe (one tree level per step; with and without the refill after a
miss). Every output is checked against the target alone; SpecPipe's measured time between
tokens is set beside the prediction E(T) (eq. 2 less the refill's saving, pipeline/plan.py).
Prompts that carry a Predicted Output (``--prompts edits``) add SpecPipe + prediction (its
chains grafted onto the tree, what a SpecPipe target runs such a request in: pipeline.predicted)
and PP + chain + prediction (the round loop with it), each set against SpecPipe without it."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable

from specctl.bench.spread import spread
from specctl.bench.stages import StageProcesses, StageProcessSettings
from specctl.engine.loader import LoadedModel
from specctl.engine.model import Decoder
from specctl.pipeline.local import LocalPipeline
from specctl.pipeline.microbatch import MicroBatchLane
from specctl.pipeline.plan import WidthOption
from specctl.pipeline.specpipe import specpipe_generate
from specctl.pipeline.token_source import TreeShape
from specctl.runtime.compute import ComputeThread
from specctl.runtime.emulation import sleep_rest
from specctl.spec.decode import DecodeSession
from specctl.spec.drafters import ModelChainDrafter
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import LocalSpeculator, generate, run_session

MODES = ("pp", "pp+chain", "specpipe")
NO_REFILL = "specpipe r=0"  # SpecPipe with the missed token alone after a miss: the refill's same-run baseline
PREDICTED = "pp+chain+prediction"  # the chain drafting where the prediction does not cover the output
SPECPIPE_PREDICTED = "specpipe+prediction"  # the prediction grafted onto SpecPipe's tree (pipeline.predicted)
PREDICTED_MODES = (PREDICTED, SPECPIPE_PREDICTED)
BATCH_MODES = ("pp+chain xS", "specpipe-db xS")  # S sessions at once: one micro-batch in flight, or several


@dataclass(frozen=True, slots=True)
class PipelineBench:
    stages: tuple[int, ...] = (1, 2, 4)
    max_tokens: int = 48
    delay_s: float = 0.05
    depth: int = 4  # pp+chain proposal depth
    shape: TreeShape = TreeShape(4, 2)  # SpecPipe level width and top-k
    repeats: int = 1
    sessions: int = 8  # the batch rows' concurrent sessions (0 = no batch rows)
    model: str | None = None  # stages 2..n as processes loading this model; None: stage threads in this process
    dtype: str = "fp32"  # the stage processes' dtype


class DelayedDecoder:
    """The one-stage baseline: the whole target, each forward taking the emulated stage time
    (its real compute inside it, as on every stage)."""

    def __init__(self, decoder: Decoder, delay_s: float) -> None:
        self.decoder, self.delay_s, self.spec = decoder, delay_s, decoder.spec

    def new_cache(self, capacity, pool=None):
        return self.decoder.new_cache(capacity, pool)

    def __call__(self, *args, **kwargs):
        return self._slowed(self.decoder, *args, **kwargs)

    def forward_many(self, *args, **kwargs):
        return self._slowed(self.decoder.forward_many, *args, **kwargs)

    def _slowed(self, forward, *args, **kwargs):
        started = time.perf_counter()
        out = forward(*args, **kwargs)
        sleep_rest(started, self.delay_s)
        return out


def pipeline_modes(stages: int, shape: TreeShape, predicted: bool = False) -> tuple[str, ...]:
    """The single-session modes measured at a stage count (SpecPipe without its refill too,
    where the shape refills; with the prompts' predictions where they carry them)."""
    if stages == 1:
        return "pp", "pp+chain", *((PREDICTED,) if predicted else ())
    return MODES + ((NO_REFILL,) if shape.refill_depth(stages) else ()) + (PREDICTED_MODES if predicted else ())


def _run_one(mode: str, decoder, draft: Decoder, prompt: list[int], params: SamplingParams,
             bench: PipelineBench, prediction: tuple[int, ...] = ()) -> dict:
    started = time.perf_counter()
    result: dict = {"hit_rate": None, "step_ms": None, "bubbles_per_token": None}
    if mode == "pp":
        tokens, stats, _ = generate(decoder, prompt, params)
    elif mode in ("pp+chain", PREDICTED):
        if mode == PREDICTED:
            params = replace(params, prediction=prediction)
        tokens, stats, _ = generate(decoder, prompt, params, ModelChainDrafter(draft, bench.depth))
        result["prediction_accepted"] = stats.prediction_accepted
    else:
        shape = replace(bench.shape, refill=0) if mode == NO_REFILL else bench.shape
        if mode == SPECPIPE_PREDICTED:
            params = replace(params, prediction=prediction)
        tokens, stats, _, pipe = specpipe_generate(decoder, draft, prompt, params, shape)
        result["prediction_accepted"] = stats.prediction_accepted
        result["refill"] = shape.refill_depth(decoder.stages)
        result["refill_tokens_per_token"] = pipe.refill_tokens / pipe.steps if pipe.steps else 0.0
        result["hit_rate"] = pipe.hits / pipe.steps if pipe.steps else 0.0
        result["bubbles_per_token"] = pipe.bubbles / pipe.steps if pipe.steps else 0.0
        result["stage1_step_ms"] = pipe.to_dict()["stage1_step_ms"]
    wall = time.perf_counter() - started
    decode_s = max(wall - stats.prefill_s, 1e-9)
    result.update(tokens=tokens, tbt_ms=1e3 * decode_s / max(len(tokens) - 1, 1), wall_s=wall)
    return result


def slowest_step_ms(stage1_step_ms: float, before: list[tuple[float, int]], after: list[tuple[float, int]],
                    delay_s: float) -> float:
    """t(w): the slowest stage's time per level. Stage 1's is measured by SpecPipe (drafting
    and its layers inside its device time); stages 2..n's is the emulated time, or their
    compute per forward over the run (busy seconds and forwards before and after it) where
    that is longer."""
    stages = [1e3 * (busy - b0) / max(n - n0, 1) for (busy, n), (b0, n0) in zip(after, before)]
    return max([stage1_step_ms] + [max(1e3 * delay_s, ms) for ms in stages])


async def _run_batch(decoder, draft: Decoder, prompts: list[list[int]], params: SamplingParams,
                     bench: PipelineBench, stages: int, micro_batches: bool) -> dict:
    """Every prompt as a session at once through the round loop (chain drafts, stage 1's
    compute thread verifying groups of sessions due together): with ``micro_batches`` the
    groups overlap in the stages (SpecPipe-DB), without it one group is in the chain at a time."""
    compute = ComputeThread("bench-batch", max_batch=-(-len(prompts) // stages))
    lane = compute.lane(owns_thread=True)
    verify_lane = MicroBatchLane(lane) if micro_batches else lane

    async def one(prompt: list[int]) -> list[int]:
        drafter = ModelChainDrafter(draft, bench.depth)
        session = await lane.run(DecodeSession, decoder, prompt, params, (), None, None, drafter.max_nodes)
        await run_session(session, LocalSpeculator(drafter, lane), verify_lane, lambda tokens, result: None)
        return session.output

    started = time.perf_counter()
    try:
        outputs = await asyncio.gather(*(one(p) for p in prompts))
    finally:
        lane.stop()
    wall = time.perf_counter() - started
    tokens = sum(len(o) for o in outputs)
    return {"outputs": outputs, "tbt_ms": 1e3 * wall / max(len(o) for o in outputs), "wall_s": wall,
            "tokens_per_s": tokens / wall, "hit_rate": None, "step_ms": None, "sessions": len(prompts)}


async def run_pipeline_bench(target: LoadedModel, draft: LoadedModel, prompts: list[list[int]], bench: PipelineBench,
                             advance: Callable[[str], None] = lambda what: None,
                             predictions: list[tuple[int, ...]] | None = None) -> dict:
    """``predictions``: each prompt's Predicted Output (token ids; () for none), for the
    PP + chain + prediction rows."""
    predictions = predictions or [()] * len(prompts)
    params = SamplingParams(max_tokens=bench.max_tokens, ignore_eos=True)
    references = [generate(target.decoder, prompt, params)[0] for prompt in prompts]
    rows = []
    for n in bench.stages:
        pipeline = None
        if n == 1:
            decoder = DelayedDecoder(target.decoder, bench.delay_s)
        else:
            pipeline = StageProcesses(target, n, StageProcessSettings(bench.model, bench.dtype, bench.delay_s)) \
                if bench.model else LocalPipeline(target, n, delay_s=bench.delay_s)
            decoder = (await pipeline.start()).decoder
        modes = pipeline_modes(n, bench.shape, any(predictions))
        try:
            runs: dict[str, list[list[dict]]] = {mode: [[] for _ in range(bench.repeats)] for mode in modes}
            for repeat in range(bench.repeats):
                for i, prompt in enumerate(prompts):
                    for mode in modes:  # interleaved: a slow moment of the machine hits every mode alike
                        single = mode.startswith("specpipe")
                        before = await pipeline.counters() if single else []
                        result = await asyncio.to_thread(_run_one, mode, decoder, draft.decoder, prompt, params, bench,
                                                         predictions[i])
                        if single:
                            result["step_ms"] = slowest_step_ms(result.pop("stage1_step_ms"), before,
                                                                await pipeline.counters(), bench.delay_s)
                        result["same"] = result.pop("tokens") == references[i]
                        runs[mode][repeat].append(result)
                        advance(f"{n} stage{'s' * (n > 1)} {mode}")
            if n > 1 and bench.sessions:
                for mode in BATCH_MODES:
                    batch = [prompts[i % len(prompts)] for i in range(bench.sessions)]
                    result = await _run_batch(decoder, draft.decoder, batch, params, bench, n, "db" in mode)
                    outputs = result.pop("outputs")
                    result["same_count"] = sum(o == references[i % len(prompts)] for i, o in enumerate(outputs))
                    result["same"] = result["same_count"] == len(outputs)
                    runs[mode.replace("S", str(bench.sessions))] = [[result]]
                    advance(f"{n} stages {mode}")
        finally:
            if pipeline is not None:
                await pipeline.close()
        rows.extend(_summarise(n, mode, turns) for mode, turns in runs.items())
    _add_predictions(rows)
    return {"settings": {"stages": list(bench.stages), "max_tokens": bench.max_tokens,
                         "stage_delay_ms": 1e3 * bench.delay_s, "chain_depth": bench.depth,
                         "width": bench.shape.width, "topk": bench.shape.topk, "spread": bench.shape.spread,
                         "refill": bench.shape.refill,
                         "repeats": bench.repeats,
                         "stages_as": "processes" if bench.model else "threads of one process",
                         "prompts": len(prompts), "predictions": sum(bool(p) for p in predictions)},
            "rows": rows}


def _summarise(stages: int, mode: str, per_repeat: list[list[dict]]) -> dict:
    tbt = [statistics.mean(r["tbt_ms"] for r in turn) for turn in per_repeat]
    flat = [r for turn in per_repeat for r in turn]
    aggregate = [r["tokens_per_s"] for r in flat if "tokens_per_s" in r]
    row = {"stages": stages, "mode": mode, "sessions": flat[0].get("sessions", 1),
           "tbt_ms": round(statistics.median(tbt), 2),
           "tbt_ms_min": round(min(tbt), 2), "tbt_ms_max": round(max(tbt), 2),
           "tokens_per_s": round(statistics.median(aggregate) if aggregate else 1e3 / statistics.median(tbt), 3),
           "same_as_target": sum(r.get("same_count", int(r["same"])) for r in flat),
           "runs": sum(r.get("sessions", 1) for r in flat)}
    if mode in PREDICTED_MODES:
        row["prediction_accepted"] = sum(r["prediction_accepted"] for r in flat)
    if not aggregate:  # one session per run: each prompt's time between tokens, its median over the repeats
        row["tbt_ms_per_prompt"] = [round(statistics.median(turn[i]["tbt_ms"] for turn in per_repeat), 2)
                                    for i in range(len(per_repeat[0]))]
    if flat[0].get("hit_rate") is not None:  # a SpecPipe session per run
        row["refill"] = flat[0].get("refill", 0)
        row["refill_tokens_per_token"] = round(statistics.mean(r.get("refill_tokens_per_token", 0.0) for r in flat), 4)
        row["hit_rate"] = round(statistics.mean(r["hit_rate"] for r in flat), 4)
        row["step_ms"] = round(statistics.mean(r["step_ms"] for r in flat), 2)
        # Steps whose level had been pruned away entirely: they cost a step and give no token
        # (the paper's E(T) has no term for them).
        row["bubbles_per_token"] = round(statistics.mean(r["bubbles_per_token"] for r in flat), 4)
    return row


def _add_predictions(rows: list[dict]) -> None:
    """Ratios against plain PP and PP+chain at the same stage count, and SpecPipe's E(T)
    (eq. 2): t(w) = the slowest stage's measured time per level, P = the measured share of
    steps whose verified token was in the tree."""
    by = {(r["stages"], r["mode"]): r for r in rows}
    for row in rows:
        batch = row["mode"].endswith(tuple(f"x{n}" for n in range(1, 1000)))
        pp = by.get((row["stages"], "pp"))
        chain = next((r for r in rows if r["stages"] == row["stages"] and r["mode"].startswith("pp+chain x")), None) \
            if batch else by.get((row["stages"], "pp+chain"))
        # Throughput ratios (a batch row's tokens/s is all its sessions' together).
        row["vs_pp"] = round(row["tokens_per_s"] / pp["tokens_per_s"], 3) if pp else None
        row["vs_pp_chain"] = round(row["tokens_per_s"] / chain["tokens_per_s"], 3) if chain else None
        for key, baseline in (("vs_pp_per_prompt", pp), ("vs_pp_chain_per_prompt", chain)):
            if baseline and "tbt_ms_per_prompt" in row and "tbt_ms_per_prompt" in baseline:
                row[key] = spread(per_prompt_ratios(baseline["tbt_ms_per_prompt"], row["tbt_ms_per_prompt"]), 3)
        specpipe = by.get((row["stages"], "specpipe"))
        if row["mode"] in PREDICTED_MODES and specpipe:  # against SpecPipe without the prediction
            row["vs_specpipe"] = round(row["tokens_per_s"] / specpipe["tokens_per_s"], 3)
            if "tbt_ms_per_prompt" in specpipe:
                row["vs_specpipe_per_prompt"] = spread(per_prompt_ratios(specpipe["tbt_ms_per_prompt"],
                                                                         row["tbt_ms_per_prompt"]), 3)
        if "hit_rate" in row and row["mode"] != SPECPIPE_PREDICTED:  # (eq. 2 knows no predicted chains)
            option = WidthOption(1, row["step_ms"], row["hit_rate"])  # the width is not used
            predicted = option.expected_tbt_ms(row["stages"], row["refill"])
            row["predicted_tbt_ms"] = round(predicted, 2)
            row["prediction_error"] = round(abs(predicted - row["tbt_ms"]) / row["tbt_ms"], 4)


def per_prompt_ratios(baseline_tbt: list[float], tbt: list[float]) -> list[float]:
    """How many times faster than the baseline each prompt ran (its time between tokens over ours)."""
    return [base / max(ours, 1e-9) for base, ours in zip(baseline_tbt, tbt, strict=True)]
