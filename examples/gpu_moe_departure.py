"""Which part of gpt-oss departs on CUDA in bf16 (2026-12-06, an H100: a tiny gpt-oss's bf16 chain
left bf16 AR at token 8 of [5, 9, 13, 2], the other families' did not): the conftest's tiny
gpt-oss and its draft, static steps with CUDA graphs (as tests/test_gpu.py), eager, and each with
the experts run a row at a time (one expert input shape whatever the rows routed)."""
import sys
import tempfile
from pathlib import Path

import torch

from specctl.engine.fusion import fuse_projections
from specctl.engine.loader import load_decoder
from specctl.engine.moe import SparseMoE
from specctl.engine.tiny import make_tiny_model
from specctl.spec.drafters import ModelChainDrafter, NgramDrafter
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate

PROMPTS = [[5, 9, 13, 2], [7, 8, 9, 10, 7, 8, 9] * 3, [100], list(range(30, 100))]
arch = sys.argv[1] if len(sys.argv) > 1 else "gpt_oss"
root = Path(tempfile.mkdtemp())
kw = dict(init_std=0.2, norm_std=0.3, bias_std=0.1, sliding_window=24) if arch == "gpt_oss" else {}
paths = {"target": make_tiny_model(root / "t", arch, seed=40, **kw),
         "draft": make_tiny_model(root / "d", arch, seed=41, layers=2, **kw)}
original = SparseMoE.forward


def row_at_a_time(self, x):
    rows = x.reshape(-1, x.shape[-1])
    return torch.cat([original(self, rows[i:i + 1]) for i in range(rows.shape[0])]).reshape(x.shape)


for variant in ("static", "eager", "static, experts a row at a time", "eager, experts a row at a time"):
    SparseMoE.forward = row_at_a_time if "row" in variant else original

    def cuda(name):
        decoder = fuse_projections(load_decoder(paths[name], torch.bfloat16, device="cuda"))
        return decoder.use_static_steps(graphs=True) if variant.startswith("static") else decoder

    target, draft = cuda("target"), cuda("draft")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    departures = []
    for prompt in PROMPTS:
        ar = generate(target, prompt, params)[0]
        for name, drafter in (("chain", ModelChainDrafter(draft, 4)), ("ngram", NgramDrafter(4))):
            out = generate(target, prompt, params, drafter)[0]
            at = next((i for i, (a, b) in enumerate(zip(ar, out)) if a != b), None)
            departures.append(f"{name}@{at}" if at is not None else "same")
        p = len(prompt)
        one = target.new_cache(p + 64)
        target(torch.tensor(prompt), torch.arange(p), one)
        singles = torch.cat([target(torch.tensor([t]), torch.tensor([p + i]), one) for i, t in enumerate(ar[:5])])
        five = target.new_cache(p + 64)
        target(torch.tensor(prompt), torch.arange(p), five)
        rows = target(torch.tensor(ar[:5]), torch.arange(p, p + 5), five)
        departures.append(f"rows {[torch.equal(singles[i], rows[i]) for i in range(5)]}")
    print(f"{arch} {variant}: {departures}", flush=True)
