"""Row-exact attention in calls of two rows (``specctl_kernels.torch_backend.rows_in_blocks``)
against a call a row, on a CPU whose batched-rows probe fails: the 1.5B target in bf16
(row-exact), a prompt of random tokens prefilled, then decode steps and 11-token verifications
(a chain's rows) over it, the two ways alternated in one process (processes on a shared VM
differ by more than the change). Prints min / median / max of each and whether each way's
verification rows' logits equal, bit for bit, its decode steps' over the same tokens (each way
is exact by itself; the two ways' bits differ, as any two kernels' do).

    python examples/row_blocks_check.py [--context 1024] [--rounds 3] [--model qwen2.5-coder-1.5b]"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console

from specctl.config import Config
from specctl.spec.factory import load_named
from specctl_kernels import torch_backend

WAYS = ("two rows a call", "a call a row")


def spread(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in (min(values), statistics.median(values), max(values)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1024, help="prompt length (random tokens)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each size a round")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    args = parser.parse_args()
    decoder = load_named(args.model, Config(dtype="bf16"), Console(stderr=True), target=True).decoder
    spec = decoder.spec
    shape = (spec.num_heads // spec.num_kv_heads, spec.head_dim, spec.head_dim, torch.bfloat16)
    probed = torch_backend.fixed_blocks_agree
    print(f"row-exact {decoder.row_exact}, batched rows agree {torch_backend.batched_rows_agree(*shape)}, "
          f"fixed blocks agree {probed(*shape)}")
    prompt = torch.randint(0, spec.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    chain = torch.randint(0, spec.vocab_size, (11,), generator=torch.Generator().manual_seed(1))
    timings = {way: {"prefill s": [], "decode step ms": [], "11-token verification ms": []} for way in WAYS}
    exact = {way: True for way in WAYS}
    for turn in range(args.rounds):
        for way in WAYS if turn % 2 == 0 else WAYS[::-1]:
            torch_backend.fixed_blocks_agree = probed if way == WAYS[0] else (lambda *shape: False)
            cache = decoder.new_cache(args.context + 16)
            start = time.perf_counter()
            decoder(prompt, torch.arange(args.context), cache, logits_at=torch.tensor([args.context - 1]))
            timings[way]["prefill s"].append(time.perf_counter() - start)
            for n, name in ((1, "decode step ms"), (11, "11-token verification ms")):
                positions = torch.arange(args.context, args.context + n)
                for _ in range(args.steps):
                    start = time.perf_counter()
                    logits = decoder(chain[:n], positions, cache)
                    int(logits[-1].argmax())
                    timings[way][name].append((time.perf_counter() - start) * 1e3)
                    cache.truncate(args.context)
            verified = decoder(chain, torch.arange(args.context, args.context + 11), cache)
            cache.truncate(args.context)
            for i in range(11):  # each verified row's logits, bit for bit, as decode steps over the same tokens give them
                step = decoder(chain[i : i + 1], torch.tensor([args.context + i]), cache)
                exact[way] &= torch.equal(step[-1], verified[i])
            cache.release()
    torch_backend.fixed_blocks_agree = probed
    for way in WAYS:
        print(f"{way}: " + ", ".join(f"{name} {spread(values)}" for name, values in timings[way].items())
              + f"; verification rows as decode steps: {'yes' if exact[way] else 'NO'}")


if __name__ == "__main__":
    main()
