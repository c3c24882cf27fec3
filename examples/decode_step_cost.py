"""One-token steps through engine.decode_step against the same steps through the modules,
alternated in one process (this VM's speed drifts by 15 % between processes), on caches of
their own: ms per step (min / median / max) and whether the logits and KV are the same bits.

    python examples/decode_step_cost.py [--models draft,target] [--context 100] [--steps 200] [--sessions 1]

draft: the default pair's int8 0.5B draft (as `specctl draft` loads it on a CPU); target: the
bf16 1.5B as a CPU target (packed, row-exact). ``--sessions N``: a token for each of N sessions a
step, in one forward (a draft server's batched step), their contexts 0-15 % apart."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specctl.config import build_config
from specctl.spec.factory import load_named

TEXT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n'


def compare(name: str, quant: str, target: bool, context: int, steps: int, sessions: int) -> None:
    model = load_named(name, build_config("desktop"), quant=quant, target=target)
    decoder, stepper = model.decoder, model.decoder.decode_step
    if stepper is None:
        raise SystemExit(f"{name}: no decode step for this model on this machine")
    text = model.tokenizer.encode(TEXT * (context // 10 + 1))
    prompts = [torch.tensor(text[: context + context * s // (7 * sessions)]) for s in range(sessions)]
    caches = {way: [decoder.new_cache(len(ids) + steps + 1) for ids in prompts] for way in ("decode step", "modules")}
    times: dict[str, list[float]] = {way: [] for way in caches}
    same = True
    at = [torch.tensor([0])] * sessions
    with torch.inference_mode():
        for way in caches:
            for ids, cache in zip(prompts, caches[way]):
                decoder.forward(ids, torch.arange(len(ids)), cache)
        tokens = [ids[-1:] for ids in prompts]
        for _ in range(steps):
            outs = {}
            for way, runner in (("decode step", stepper), ("modules", None)):
                decoder.decode_step = runner
                positions = [torch.tensor([cache.length]) for cache in caches[way]]
                started = time.perf_counter()
                outs[way] = decoder.forward_many(tokens, positions, caches[way], [None] * sessions, at)
                times[way].append(time.perf_counter() - started)
            decoder.decode_step = stepper
            same &= all(torch.equal(a, b) for a, b in zip(outs["decode step"], outs["modules"]))
            tokens = [out.argmax(-1) for out in outs["decode step"]]
        same &= all(torch.equal(a.kv[..., : a.length, :], b.kv[..., : b.length, :])
                    for a, b in zip(caches["decode step"], caches["modules"]))
    print(f"{name} ({quant if quant != 'none' else 'bf16'}), {sessions} session(s) a step, "
          f"{context} tokens cached, {steps} steps each, alternated")
    for way, seconds in times.items():
        ms = sorted(s * 1e3 for s in seconds)
        print(f"  {way:12s} ms a step: min {ms[0]:.2f}  median {statistics.median(ms):.2f}  max {ms[-1]:.2f}")
    print(f"  same logits and KV every step: {'yes' if same else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="draft,target")
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sessions", type=int, default=1)
    args = parser.parse_args()
    for which in args.models.split(","):
        if which == "draft":
            compare("qwen2.5-coder-0.5b", "int8", False, args.context, args.steps, args.sessions)
        elif which == "target":
            compare("qwen2.5-coder-1.5b", "none", True, args.context, max(1, args.steps // 8), args.sessions)
        else:
            raise SystemExit(f"unknown model {which!r}: draft or target")


if __name__ == "__main__":
    main()
