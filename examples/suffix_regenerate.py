"""Suffix decoding where it is meant to pay: requests that repeat earlier output. Each prompt
is asked, then asked again (a client regenerating, an agent retrying a step), greedy, with
the target alone (ar), the n-gram lookup and suffix decoding; one suffix drafter serves every
request, as a target instance's does (`verify --draft suffix`), so the second ask finds the
first's output and later prompts find earlier ones'. Modes take turns prompt by prompt.
Prints tokens/s per pass and mode, the ratio to ar, mean accepted length and how many outputs
equal ar's; writes JSON.

    python examples/suffix_regenerate.py OUT.json [--prompts heldout] [--limit 8] [-n 48] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import time

from specctl.bench.prompts import load_prompts
from specctl.config import build_config
from specctl.engine.text import encode_user_text
from specctl.spec.factory import apply_threads, load_pair
from specctl.spec.drafters import NgramDrafter, NoDrafter
from specctl.spec.rounds import generate
from specctl.spec.params import SamplingParams
from specctl.spec.suffix import SuffixDrafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--prompts", default="heldout")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("-n", "--max-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="bf16")
    args = parser.parse_args()
    config = build_config(None, mode="ar", dtype=args.dtype)
    apply_threads(config)
    target, _ = load_pair(config)
    drafters = {"ar": NoDrafter(), "ngram": NgramDrafter(config.depth), "suffix": SuffixDrafter(config.depth)}
    params = SamplingParams(max_tokens=args.max_tokens)
    prompts = load_prompts(args.prompts)[:args.limit]
    generate(target.decoder, [1, 2, 3], SamplingParams(max_tokens=4))  # warm-up
    rows = {(mode, ask): {"tokens": 0, "wall_s": 0.0, "rounds": 0, "accepted": 0, "drafts": 0, "same": 0}
            for mode in drafters for ask in ("first", "again")}
    for index, prompt in enumerate(prompts):
        ids = encode_user_text(target.tokenizer, prompt.prompt, prompt.chat)
        modes = list(drafters)[index % 3:] + list(drafters)[:index % 3]
        outputs = {}
        for mode in modes:
            for ask in ("first", "again"):
                started = time.perf_counter()
                out, stats, _ = generate(target.decoder, ids, params, drafters[mode], eos_token_ids=target.eos_token_ids)
                row = rows[mode, ask]
                row["wall_s"] += time.perf_counter() - started
                row["tokens"] += len(out)
                row["rounds"] += stats.rounds
                row["accepted"] += stats.accepted
                row["drafts"] += stats.drafts
                outputs[mode, ask] = out
        for mode, ask in outputs:
            rows[mode, ask]["same"] += outputs[mode, ask] == outputs["ar", ask]
        print(f"prompt {index + 1}/{len(prompts)} done", flush=True)
    report = []
    for (mode, ask), row in rows.items():
        speed = row["tokens"] / row["wall_s"]
        ar = rows["ar", ask]["tokens"] / rows["ar", ask]["wall_s"]
        report.append({"mode": mode, "ask": ask, "tokens_per_s": round(speed, 2), "vs_ar": round(speed / ar, 2),
                       "mean_accepted_length": round(1 + row["accepted"] / row["drafts"], 2) if row["drafts"] else None,
                       "same_as_ar": f"{row['same']}/{len(prompts)}", **row})
        print(f"{mode:7s} {ask:6s} {speed:6.2f} tok/s  {speed / ar:.2f}x ar  MAL "
              f"{report[-1]['mean_accepted_length']}  same as ar {row['same']}/{len(prompts)}")
    with open(args.out, "w") as handle:
        json.dump({"settings": {**vars(args), "target": config.target, "depth": config.depth}, "rows": report},
                  handle, indent=1)


if __name__ == "__main__":
    main()
