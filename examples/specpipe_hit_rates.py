"""SpecPipe's hit rate on every held-out prompt, and the E(T)-predicted time between tokens against plain PP.

    python examples/specpipe_hit_rates.py OUT.json [MEASURED.json] [--width W] [--topk K] [--prompts SET] [--limit N]

The tree a session grows does not depend on timing, so its hit rate P is measured here in one
process (4 stages as threads, no emulated delay; Qwen2.5-Coder 1.5B / 0.5B, bf16, 32 tokens;
width w, top-k k and the level rule as given, default 4, 2 and likeliest; the held-out prompts by default). The step time t and plain PP's time between tokens come from a `specctl bench pipeline`
run at 4 stages (MEASURED.json, default: the committed one), whose measured TBT E(T) matched
within 4-14 %. Prints one row per prompt and min / median / max."""
import argparse
import asyncio
import json
import statistics

from rich.console import Console

from specctl.bench.prompts import load_prompts
from specctl.config import build_config
from specctl.pipeline.local import LocalPipeline
from specctl.pipeline.specpipe import specpipe_generate
from specctl.pipeline.token_source import TreeShape
from specctl.spec.factory import apply_threads, load_named
from specctl.spec.params import SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("measured", nargs="?", default="docs/results/bench-pipeline-qwen-bf16-800ms-4-stages-prefill-root.json")
parser.add_argument("--width", type=int, default=4)
parser.add_argument("--topk", type=int, default=2)
parser.add_argument("--spread", default="likeliest")
parser.add_argument("--prompts", default="heldout")
parser.add_argument("--limit", type=int, default=None)
args = parser.parse_args()
measured = json.load(open(args.measured))
N = 4
STEP_MS = next(r["step_ms"] for r in measured["rows"] if r["mode"] == "specpipe" and r["stages"] == N)
PP_MS = next(r["tbt_ms"] for r in measured["rows"] if r["mode"] == "pp" and r["stages"] == N)
config = build_config(None, target="qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", dtype="bf16", threads=None,
                      draft_quant="none", target_quant="none")
apply_threads(config)
c = Console(stderr=True)
target = load_named(config.target, config, c, target=True)
draft = load_named(config.draft, config, c)
prompts = load_prompts(args.prompts)[: args.limit]
rows = []

async def main():
    async with LocalPipeline(target, N) as pipe:
        for i, p in enumerate(prompts):
            ids = target.tokenizer.encode(p.prompt)
            toks, stats, _, ps = await asyncio.to_thread(specpipe_generate, pipe.staged.decoder, draft.decoder, ids,
                                                        SamplingParams(max_tokens=32, ignore_eos=True), TreeShape(args.width, args.topk, args.spread))
            predicted = STEP_MS * (1 + (1 - ps.hit_rate) * N)
            rows.append({"prompt": i + 1, "kind": p.kind, "hit_rate": round(ps.hit_rate, 4), "steps": ps.steps,
                         "flushes": ps.flushes, "levels_sent": ps.levels_sent, "predicted_tbt_ms": round(predicted, 1),
                         "predicted_vs_pp": round(PP_MS / predicted, 3)})
            print(rows[-1], flush=True)
asyncio.run(main())
ratios = [r["predicted_vs_pp"] for r in rows]
summary = {"prompts": len(rows), "hit_rate_min_median_max": [min(r["hit_rate"] for r in rows), statistics.median(r["hit_rate"] for r in rows), max(r["hit_rate"] for r in rows)],
           "predicted_vs_pp_min_median_max": [min(ratios), statistics.median(ratios), max(ratios)],
           "at_least_3x": sum(x >= 3 for x in ratios)}
print(summary)
json.dump({"rows": rows, "summary": summary, "step_ms": STEP_MS, "pp_tbt_ms": PP_MS, "stages": N, "width": args.width,
           "topk": args.topk, "spread": args.spread, "prompts": args.prompts, "max_tokens": 32, "dtype": "bf16"}, open(args.out, "w"), indent=1)
