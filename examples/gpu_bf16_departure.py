"""Where bf16 speculative output departs from bf16 AR on CUDA (a lent GPU; 2026-12-06 the e2e run
found every speculative mode the same as AR on 1 of 4 prompts, where 2026-11-27 found 4 of 4).

Random weights of the Qwen2.5 1.5B shape, as examples/gpu_e2e_random_weights.py builds them.
1. generate: AR against n-gram d8 and a self-drafting chain d4 on the e2e's prompts: the first
   index where each departs.
2. the step itself: after a prefill, 5 tokens as 5 one-token steps, as one 5-row step with a
   chain's mask (a verification) and as one causal 5-row step: are the rows' logits and the KV
   written the same bits?
Each on static steps with CUDA graphs and compiled layers (the e2e's), with graphs alone, and
eagerly. Usage: python examples/gpu_bf16_departure.py [TOKENS] (VARIANTS=eager DEVICE=cpu SHAPE=0.5b for a
check on the CPU; MIN_BUCKET / ONE_BUCKET: see below)"""
import os
import sys
import time

import torch

try:  # the code of 2026-11-27 (e881f53) keeps these elsewhere
    from specctl.bench.shapes import random_decoder, shape_config
    from specctl.engine.fusion import fuse_projections
    from specctl.spec.params import SamplingParams
except ImportError:
    from specctl.bench.kernels import random_decoder, shape_config
    from specctl.engine.layers import fuse_projections
    from specctl.spec.sampling import SamplingParams
from specctl.spec.drafters import ModelChainDrafter, NgramDrafter
from specctl.spec.rounds import generate

DEVICE, SHAPE = os.environ.get("DEVICE", "cuda"), os.environ.get("SHAPE", "1.5b")
# MIN_BUCKET=N: every static step padded to at least N rows (64, or ONE_BUCKET=1: one shape for
# every forward; 16: a decode step shaped as a verification of up to 16 tokens)
MIN_BUCKET = 64 if os.environ.get("ONE_BUCKET") else int(os.environ.get("MIN_BUCKET", "0"))
if MIN_BUCKET:
    import specctl.engine.static as static_steps

    static_steps.bucket_for = lambda n: next((size for size in static_steps.BUCKETS if size >= max(n, MIN_BUCKET)), None)
    print(f"static steps padded to at least {MIN_BUCKET} rows", flush=True)


def build(static: str):
    torch.manual_seed(0)
    dec = random_decoder(shape_config(SHAPE), torch.bfloat16, DEVICE)
    fuse_projections(dec)
    if static == "graphs+compile":
        return dec.use_static_steps(graphs=True, compile=True)
    if static == "graphs":
        return dec.use_static_steps(graphs=True, compile=False)
    return dec


def first_departure(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def step_rows(target, prompt: list[int], tokens: list[int]) -> None:
    n, p = len(tokens), len(prompt)
    ids = torch.tensor(prompt)

    def prefilled():
        cache = target.new_cache(p + 64)
        target(ids, torch.arange(p), cache, logits_at=torch.tensor([p - 1]))
        return cache

    one = prefilled()
    singles = torch.cat([target(torch.tensor([t]), torch.tensor([p + i]), one) for i, t in enumerate(tokens)])
    chain_mask = torch.ones(n, p + n, dtype=torch.bool)
    chain_mask[:, p:] = torch.ones(n, n, dtype=torch.bool).tril()
    masked, causal = prefilled(), prefilled()
    rows_masked = target(torch.tensor(tokens), torch.arange(p, p + n), masked, mask=chain_mask)
    rows_causal = target(torch.tensor(tokens), torch.arange(p, p + n), causal)
    for name, rows, cache in (("5 rows, chain mask", rows_masked, masked), ("5 rows, causal", rows_causal, causal)):
        same_rows = [torch.equal(singles[i], rows[i]) for i in range(n)]
        same_argmax = [int(singles[i].argmax()) == int(rows[i].argmax()) for i in range(n)]
        diff = (singles - rows).abs().max().item()
        k_same = torch.equal(one.k[..., p:p + n, :], cache.k[..., p:p + n, :])
        v_same = torch.equal(one.v[..., p:p + n, :], cache.v[..., p:p + n, :])
        print(f"    prompt {p}: 1-row steps vs {name}: rows equal {same_rows} argmax equal {same_argmax} "
              f"max |diff| {diff:.3g}  KV written equal k {k_same} v {v_same}", flush=True)
    for cache in (one, masked, causal):
        cache.release()


def main():
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 150000, (length,), generator=gen).tolist() for length in (40, 200, 90, 400)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for static in os.environ.get("VARIANTS", "graphs+compile,graphs,eager").split(","):
        start = time.perf_counter()
        target = build(static)
        print(f"== {static}", flush=True)
        for prompt in prompts:
            start_ar = time.perf_counter()
            ar = generate(target, prompt, params)[0]
            print(f"  prompt {len(prompt)}: ar {len(ar) / (time.perf_counter() - start_ar):.0f} tok/s", flush=True)
            for name, drafter in (("ngram d8", NgramDrafter(8)), ("chain self d4", ModelChainDrafter(target, 4))):
                out = generate(target, prompt, params, drafter)[0]
                at = first_departure(ar, out)
                print(f"  prompt {len(prompt)}: {name} " + ("same as ar" if at is None else
                      f"departs at token {at}: ar {ar[max(0, at - 2):at + 3]} vs {out[max(0, at - 2):at + 3]}"),
                      flush=True)
            step_rows(target, prompt, ar[:5])
        print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
        del target
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
