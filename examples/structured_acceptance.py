"""What structured output costs speculation with the Qwen pair: chat prompts that ask for JSON,
answered under a JSON schema (spec.structured) by the target alone and by chain speculation —
the draft following the grammar (as specctl drafts) and, for comparison, drafting free — every
output compared with the target alone's; acceptance, mean accepted length and tokens/s beside
the same prompts answered free. Writes the table and a JSON file.

    python examples/structured_acceptance.py OUT.json [--depth 6] [--max-tokens 96] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import json
import time

from specctl.config import build_config
from specctl.engine.text import encode_chat
from specctl.spec.factory import apply_threads, load_pair, make_drafter
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate
from specctl.spec.structured import Structure


def _free_guide(self, device):
    """A draft guide that has lost track: the draft drafts free (the comparison row)."""
    guide = GUIDE(self, device)
    guide.lost = True
    return guide


GUIDE = Structure.guide

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "languages": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "languages"]}
FUNCTION = {"type": "object", "properties": {"name": {"type": "string"}, "parameters": {
    "type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}, "type": {"type": "string"}},
                               "required": ["name", "type"]}}, "returns": {"type": "string"}},
            "required": ["name", "parameters", "returns"]}
BUG = {"type": "object", "properties": {"file": {"type": "string"}, "line": {"type": "integer"},
                                        "severity": {"enum": ["low", "medium", "high"]}, "fix": {"type": "string"}},
       "required": ["file", "line", "severity", "fix"]}
CASES = [
    ("Describe a fictional Python developer as JSON with name, age and languages.", PERSON),
    ("Describe the signature of Python's built-in sorted() as JSON: name, parameters (name and type), returns.",
     FUNCTION),
    ("Report this bug as JSON (file, line, severity, fix): utils.py line 42 divides by len(items) when items may "
     "be empty.", BUG),
    ("Give me the signature of a function that merges two sorted lists, as JSON: name, parameters, returns.",
     FUNCTION),
    ("Describe a senior Rust engineer named Ada as JSON with name, age and languages.", PERSON),
    ("Report as JSON (file, line, severity, fix): in server.go line 7 the error from Close() is ignored.", BUG),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default=None, help="fp32: outputs exactly the target alone's (bf16 may differ)")
    args = parser.parse_args()
    config = build_config(None, mode="chain", depth=args.depth, dtype=args.dtype)
    apply_threads(config)
    target, draft = load_pair(config)
    drafter = make_drafter(config, draft)
    rows = []
    for label, constrained, draft_free in (("free", False, False), ("json schema", True, False),
                                           ("json schema, draft free", True, True)):
        Structure.guide = _free_guide if draft_free else GUIDE
        for mode in ("ar", "chain") if not draft_free else ("chain",):
            total = {"tokens": 0, "accepted": 0, "drafted": 0, "drafts": 0, "wall_s": 0.0, "same_as_ar": 0}
            for prompt, schema in CASES:
                ids = encode_chat(target.tokenizer, [{"role": "user", "content": prompt}])
                params = SamplingParams(max_tokens=args.max_tokens,
                                        structured=("json", json.dumps(schema)) if constrained else None)
                started = time.perf_counter()
                out, stats, _ = generate(target.decoder, ids, params, drafter if mode == "chain" else None,
                                         eos_token_ids=target.eos_token_ids, tokenizer=target.tokenizer)
                total["wall_s"] += time.perf_counter() - started
                if mode == "ar":
                    rows.append({"label": label, "prompt": prompt, "text": target.tokenizer.decode(out), "ids": out})
                reference = next(r["ids"] for r in rows if r["label"] == label.split(",")[0] and r["prompt"] == prompt)
                total["same_as_ar"] += out == reference
                total["tokens"] += len(out)
                total["accepted"] += stats.accepted
                total["drafted"] += stats.drafted
                total["drafts"] += stats.drafts
            acceptance = total["accepted"] / max(total["drafted"], 1)
            mal = 1 + total["accepted"] / max(total["drafts"], 1)
            print(f"{label:24s} {mode:6s} tokens {total['tokens']:4d}  acceptance {acceptance:.3f}  MAL {mal:.2f}  "
                  f"tok/s {total['tokens'] / total['wall_s']:.2f}  same as ar {total['same_as_ar']}/{len(CASES)}",
                  flush=True)
            rows.append({"label": label, "mode": mode, **total, "acceptance": acceptance, "mal": mal})
    with open(args.out, "w") as f:
        json.dump({"depth": args.depth, "max_tokens": args.max_tokens, "dtype": config.dtype, "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
