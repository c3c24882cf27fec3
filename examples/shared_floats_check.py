"""Row-exact prefill with and without one float32 copy of the keys for all rows of a call
(``specctl_kernels.torch_backend.shared_floats_agree``): on a CPU whose batched-rows probe fails
every prompt row keeps an attention call of its own, and each used to copy the keys before it.
Runs the 1.5B target in bf16 (row-exact) over a prompt of README text, alternating the two ways,
and checks the output, prompt logprobs and logprobs are the same bit for bit.

    python examples/shared_floats_check.py [--tokens 1500] [--repeats 2] [--model qwen2.5-coder-1.5b]

Exits 1 when the two ways differ."""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch
from rich.console import Console

from specctl.config import Config
from specctl.spec.factory import load_named
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import run_to_end
from specctl_kernels import torch_backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1500, help="prompt length")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    args = parser.parse_args()
    target = load_named(args.model, Config(dtype="bf16"), Console(stderr=True), target=True)
    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    prompt = target.tokenizer.encode(text)[: args.tokens]
    spec = target.decoder.spec
    shape = (spec.num_heads // spec.num_kv_heads, spec.head_dim, spec.head_dim, torch.bfloat16)
    print(f"prompt {len(prompt)} tokens, prefill chunk {target.decoder.prefill_chunk}, batched rows agree "
          f"{torch_backend.batched_rows_agree(*shape)}, "
          f"shared floats agree {torch_backend.shared_floats_agree(*shape)}")
    probe = torch_backend.shared_floats_agree
    params = SamplingParams(max_tokens=4, prompt_logprobs=1, logprobs=1)
    results: dict[str, tuple] = {}
    times: dict[str, list[float]] = {"per-row copies": [], "one copy": []}
    for run in ["warm-up"] + ["per-row copies", "one copy"] * args.repeats:
        torch_backend.shared_floats_agree = (lambda *shape: False) if run == "per-row copies" else probe
        start = time.perf_counter()
        session = run_to_end(target.decoder, prompt, params)
        if run in times:
            times[run].append(time.perf_counter() - start)
        results.setdefault(run, (session.output, session.prompt_logprobs, session.logprobs))
    torch_backend.shared_floats_agree = probe
    for way, seconds in times.items():
        print(f"{way}: prefill + 4 tokens " + " / ".join(f"{s:.1f}" for s in sorted(seconds)) + " s")
    same = results["per-row copies"] == results["one copy"] == results["warm-up"]
    print("output, prompt logprobs and logprobs the same:", same)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
