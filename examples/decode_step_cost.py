"""One-token steps through engine.decode_step against the same steps through the modules,
alternated in one process (this VM's speed drifts by 15 % between processes), on caches of
their own: ms per step (min / median / max) and whether the logits and KV are the same bits.

    python examples/decode_step_cost.py [--models draft,target] [--context 100] [--steps 200]

draft: the default pair's int8 0.5B draft (as `specctl draft` loads it on a CPU); target: the
bf16 1.5B as a CPU target (packed, row-exact)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specctl.config import build_config
from specctl.spec.factory import load_named

TEXT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n'


def compare(name: str, quant: str, target: bool, context: int, steps: int) -> None:
    model = load_named(name, build_config("desktop"), quant=quant, target=target)
    decoder, stepper = model.decoder, model.decoder.decode_step
    if stepper is None:
        raise SystemExit(f"{name}: no decode step for this model on this machine")
    ids = torch.tensor(model.tokenizer.encode(TEXT * (context // 20 + 1))[:context])
    caches = [decoder.new_cache(context + steps + 1) for _ in range(2)]
    times: dict[str, list[float]] = {"decode step": [], "modules": []}
    same = True
    with torch.inference_mode():
        for cache in caches:
            decoder.forward(ids, torch.arange(context), cache)
        token = ids[-1:]
        for _ in range(steps):
            outs = []
            for cache, (way, runner) in zip(caches, (("decode step", stepper), ("modules", None))):
                decoder.decode_step = runner
                started = time.perf_counter()
                outs.append(decoder.forward(token, torch.tensor([cache.length]), cache))
                times[way].append(time.perf_counter() - started)
            decoder.decode_step = stepper
            same &= torch.equal(outs[0], outs[1])
            token = outs[0].argmax(-1)
        same &= torch.equal(caches[0].kv[..., : caches[0].length, :], caches[1].kv[..., : caches[1].length, :])
    print(f"{name} ({quant if quant != 'none' else 'bf16'}), {context} tokens cached, {steps} steps each, alternated")
    for way, seconds in times.items():
        ms = sorted(s * 1e3 for s in seconds)
        print(f"  {way:12s} ms a step: min {ms[0]:.2f}  median {statistics.median(ms):.2f}  max {ms[-1]:.2f}")
    print(f"  same logits and KV every step: {'yes' if same else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="draft,target")
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    for which in args.models.split(","):
        if which == "draft":
            compare("qwen2.5-coder-0.5b", "int8", False, args.context, args.steps)
        elif which == "target":
            compare("qwen2.5-coder-1.5b", "none", True, args.context, max(1, args.steps // 8))
        else:
            raise SystemExit(f"unknown model {which!r}: draft or target")


if __name__ == "__main__":
    main()
