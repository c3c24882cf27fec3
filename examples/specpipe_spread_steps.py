"""Pipeline steps per token of SpecPipe's level rules (TreeShape.spread, TreeShape.refill) at 4 stages, one process.

    DTYPE=fp32 python examples/specpipe_spread_steps.py PROMPTS WIDTH TOPK likeliest,every-node,likeliest@0 [LIMIT]

Each entry is SPREAD or SPREAD@REFILL (levels sent with the token after a miss; default stages - 1 = 3).

Qwen2.5-Coder 1.5B split in 4 stages (threads), the 0.5B drafting, greedy, 32 tokens. A level
sent is one step of stage 1, so (levels sent - 3) / tokens is the steps per token (1 = a hit
every step; a miss costs the 3 levels still in flight), which a flush and a starved root (no
children drafted under it) both raise. Timing-free: the same in any emulation."""
import asyncio
import json
import sys

from rich.console import Console

from specctl.bench.prompts import load_prompts
from specctl.config import build_config
from specctl.pipeline.local import LocalPipeline
from specctl.pipeline.specpipe import specpipe_generate
from specctl.pipeline.token_source import TreeShape
from specctl.spec.factory import apply_threads, load_named
from specctl.spec.params import SamplingParams

DTYPE = __import__("os").environ.get("DTYPE", "bf16")
prompts_name, width, topk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
spreads = sys.argv[4].split(",")  # SPREAD or SPREAD@REFILL
limit = int(sys.argv[5]) if len(sys.argv) > 5 else None
config = build_config(None, target="qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", dtype=DTYPE, threads=None,
                      draft_quant="none", target_quant="none")
apply_threads(config)
c = Console(stderr=True)
target = load_named(config.target, config, c, target=True)
draft = load_named(config.draft, config, c)
prompts = load_prompts(prompts_name)[:limit]
res = {}


def shape_of(entry: str) -> TreeShape:
    spread, _, refill = entry.partition("@")
    return TreeShape(width, topk, spread, int(refill) if refill else None)


async def main():
    async with LocalPipeline(target, 4) as pipe:
        for spread in spreads:
            rows = []
            for i, p in enumerate(prompts):
                ids = target.tokenizer.encode(p.prompt)
                toks, stats, _, ps = await asyncio.to_thread(specpipe_generate, pipe.staged.decoder, draft.decoder, ids,
                                SamplingParams(max_tokens=32, ignore_eos=True), shape_of(spread))
                rows.append({"prompt": i + 1, "levels_sent": ps.levels_sent, "tokens": len(toks), "hits": ps.hits,
                             "flushes": ps.flushes, "bubbles": ps.bubbles, "refill_tokens": ps.refill_tokens,
                             "tokens_out": toks})
            res[spread] = rows
            spt = [(r["levels_sent"] - 3) / r["tokens"] for r in rows]
            print(spread, "steps/token per prompt", [round(x, 2) for x in spt], "mean", round(sum(spt) / len(spt), 3), flush=True)
    same = all(res[p][i]["tokens_out"] == res[spreads[0]][i]["tokens_out"] for p in spreads for i in range(len(prompts)))
    print("outputs identical across spreads:", same)

asyncio.run(main())
json.dump({"settings": {"prompts": prompts_name, "width": width, "topk": topk, "dtype": DTYPE, "limit": limit,
                        "stages": 4, "max_tokens": 32}, "runs": res}, open(sys.argv[6] if len(sys.argv) > 6 else
          f"specpipe-spread-{prompts_name}-w{width}-k{topk}-{DTYPE}.json", "w"), indent=1)
