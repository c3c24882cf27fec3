"""What packed linear weights (engine.packed, config packed_weights) change for a CPU bf16
target as specctl loads it (row-exact, probed): the load, the probe's counts, a cold prefill
of 128 / 512 / 1,024 random tokens (then one token) and 33 greedy AR tokens after 64, each
three times, packed and unpacked in one process, then packed without row-exact attention
(what exactness costs).

    python examples/packed_weights_cost.py [--model qwen2.5-coder-1.5b] [--runs 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from specctl.config import Config
from specctl.engine import rows
from specctl.spec.factory import load_named
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate


def prefill_seconds(decoder, tokens: int, seed: int) -> float:
    prompt = torch.randint(0, 32000, (tokens,), generator=torch.Generator().manual_seed(seed))
    cache = decoder.new_cache(tokens + 8)
    start = time.perf_counter()
    with torch.inference_mode():
        decoder(prompt, torch.arange(tokens), cache, logits_at=torch.tensor([tokens - 1]))
        decoder(prompt[-1:], torch.tensor([tokens]), cache)
    elapsed = time.perf_counter() - start
    cache.release()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    probed = {}
    probe = rows.decoder_row_blocks

    def recorded(decoder, quant):
        start = time.perf_counter()
        probed["counts"] = probe(decoder, quant)
        probed["seconds"] = time.perf_counter() - start
        return probed["counts"]

    rows.decoder_row_blocks = recorded
    for packed_weights, row_exact in ((True, True), (False, True), (True, False)):
        probed.update(counts=None, seconds=0.0)
        start = time.perf_counter()
        config = Config(dtype="bf16", packed_weights=packed_weights, row_exact_attention=row_exact)
        decoder = load_named(args.model, config, target=True).decoder
        load = time.perf_counter() - start
        print(f"packed_weights={packed_weights} row_exact_attention={row_exact}: loaded in {load:.1f} s, probe "
              f"{probed['counts']} in {probed['seconds']:.1f} s, {type(decoder.layers[0].mlp.down_proj).__name__}",
              flush=True)
        for tokens in (128, 512, 1024):
            times = sorted(prefill_seconds(decoder, tokens, run) for run in range(args.runs))
            print(f"  cold prefill {tokens:>5} tokens + 1: " + " ".join(f"{t:.2f}" for t in times) + " s", flush=True)
        prompt = list(range(1000, 1064))
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            generate(decoder, prompt, SamplingParams(max_tokens=33, ignore_eos=True))
            times.append(time.perf_counter() - start)
        print("  AR 33 tokens after 64: " + " ".join(f"{t:.2f}" for t in sorted(times)) + " s", flush=True)
        del decoder


if __name__ == "__main__":
    main()
