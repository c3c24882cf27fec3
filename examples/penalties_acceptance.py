"""What the logit rules cost speculation with the Qwen pair (defaults: 0.5B int8 draft, 1.5B
target), chain d=6, greedy, the first 4 held-out prompts x 32 tokens: acceptance, mean accepted
length and tokens/s with the draft following the request's rules (as specctl drafts) and, for
comparison, drafting free; every output compared with the target alone's.

    python examples/penalties_acceptance.py [--dtype fp32]
"""

from __future__ import annotations

import argparse
import json
import time
from importlib.resources import files

from specctl.config import build_config
from specctl.engine.text import encode_prompt
from specctl.spec.factory import apply_threads, load_pair, make_drafter
from specctl.spec.logit_rules import LogitRules
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate

SETTINGS = (("none", {}), ("rep 1.1", {"repetition_penalty": 1.1}),
            ("rep 1.3 + presence 0.5", {"repetition_penalty": 1.3, "presence_penalty": 0.5}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default=None, help="fp32: outputs exactly the target alone's (bf16 may differ)")
    config = build_config(None, mode="chain", depth=6, dtype=parser.parse_args().dtype)
    apply_threads(config)
    target, draft = load_pair(config)
    drafter = make_drafter(config, draft)
    lines = (files("specctl") / "data" / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines][:4]
    guide = LogitRules.guide
    for label, extra in SETTINGS:
        params = SamplingParams(max_tokens=32, ignore_eos=True, **extra)
        alone = [generate(target.decoder, encode_prompt(target.tokenizer, p), params)[0] for p in prompts]
        for draft_label, follows in (("draft follows", True), ("draft free", False)):
            if not params.adjusts_logits and not follows:
                continue
            LogitRules.guide = guide if follows else (lambda self, device: None)
            accepted = drafted = drafts = tokens = same = 0
            wall = 0.0
            for prompt, reference in zip(prompts, alone):
                started = time.perf_counter()
                out, stats, _ = generate(target.decoder, encode_prompt(target.tokenizer, prompt), params, drafter)
                wall += time.perf_counter() - started
                accepted, drafted, drafts = accepted + stats.accepted, drafted + stats.drafted, drafts + stats.drafts
                tokens, same = tokens + len(out), same + (out == reference)
            print(f"{label:24s} {draft_label:14s} acceptance {accepted / drafted:.3f}  MAL {1 + accepted / drafts:.2f}  "
                  f"tok/s {tokens / wall:.2f}  same as ar {same}/{len(prompts)}", flush=True)
    LogitRules.guide = guide


if __name__ == "__main__":
    main()
