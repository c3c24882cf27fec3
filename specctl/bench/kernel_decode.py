"""``bench kernels --decode N``: what an AR token costs in a real generation, not in one step.

The step table times one forward and its read-back; a generation adds the round loop's host
work between steps (emitting, the next step's inputs). Here N-token greedy generations of the
target alone run through ``spec.rounds.generate`` after a ``context``-token prompt, and the
time after the prefill over the N - 1 rounds is a token's cost: read back before the next step
is launched, and — where the decoder runs AR ahead (CUDA graphs, ``spec.decode.runs_ahead``) —
with the next step launched before the token is read back."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

import torch

from specctl.engine.model import Decoder
from specctl.spec.decode import runs_ahead
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate

READS_EACH, RUNS_AHEAD = "reads each token", "runs ahead"


@dataclass(frozen=True, slots=True)
class DecodeTiming:
    how: str
    tokens: int
    ms_min: float  # a token, over one generation's rounds
    ms_median: float
    ms_max: float


def time_decode(decoder: Decoder, context: int, tokens: int, repeats: int,
                on_done: Callable[[], None] = lambda: None) -> list[DecodeTiming]:
    """min / median / max ms a token over ``repeats`` greedy generations of ``tokens`` tokens
    (after one untimed generation: it captures the graphs of its cache size), each way the
    decoder can decode."""
    if tokens < 2:
        raise ValueError(f"a generation needs at least 2 tokens to time its rounds, got {tokens}")
    prompt = torch.randint(0, decoder.spec.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    ways = [(READS_EACH, False)] + ([(RUNS_AHEAD, True)] if runs_ahead(params, 1, decoder) else [])
    results = []
    for how, ahead in ways:
        per_token = []
        for _ in range(repeats + 1):
            _, stats, _ = generate(decoder, prompt, params, run_ahead=ahead)  # ends in its last read-back
            per_token.append((stats.wall_s - stats.prefill_s) / (tokens - 1) * 1e3)
        kept = per_token[1:]
        results.append(DecodeTiming(how, tokens, min(kept), statistics.median(kept), max(kept)))
        on_done()
    return results


def decode_rows(timings: list[DecodeTiming], limit_ms: float) -> list[dict]:
    """The report's rows: each way's spread, tokens/s and fraction of the bandwidth limit (of a
    step at the prompt's context: the cache grows by the generation, a few percent of it)."""
    return [{"how": t.how, "tokens": t.tokens, "ms_min_median_max": [t.ms_min, t.ms_median, t.ms_max],
             "tokens_per_s": 1e3 / t.ms_median, "fraction_of_bandwidth_limit": limit_ms / t.ms_median}
            for t in timings]
