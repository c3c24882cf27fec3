"""What routing and fusion of several drafters *could* reach with the drafters this project can
load: the ceiling of issue 14's aim (routing + fusion >= 1.3x the best single drafter).

    python examples/fusion_ceiling.py OUT.json [--drafters qwen2.5-coder-0.5b,qwen2.5-coder-1.5b@20,ngram]
                                               [--limit N] [--tokens N] [--depths 4,6,10]

Greedy chains: a chain of depth d is a prefix of the same drafter's chain of depth D > d, so
one pass measures, at every position of the target's own text (what every lossless mode
outputs), how many of each drafter's D tokens the target accepts. From those the rounds of
any policy follow without timing: each drafter alone, a router told each round's outcome
(it asks only the cheapest of the drafters whose chain goes furthest), and the fusion of
chains into one tree (for greedy chains the fused tree accepts the longest of the chains'
matches). Tokens/s then follow from step times measured here under two cost models: *one
device* (the drafters draft one after another, as `bench drafters` runs them) and *a device
per drafter* (they draft at once; a round waits for the slowest one chosen), the
verification of a fused tree costing what its node count costs the target here.

Nothing is tuned: the fused tree is the union of whole chains (no budget cut) and the router
knows each round's outcome, so both are upper bounds for `MultiDrafter`."""
import argparse
import json
import statistics
import time

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from specctl.bench.prompts import load_prompts
from specctl.config import build_config
from specctl.engine.text import encode_user_text
from specctl.spec.drafters import NgramDrafter
from specctl.spec.factory import apply_threads, load_named
from specctl.spec.params import SamplingParams
from specctl.spec.rounds import generate


def accepted_run(proposal: list[int], truth: list[int]) -> int:
    """Leading tokens of ``proposal`` equal to the target's own next tokens (pure)."""
    k = 0
    while k < len(proposal) and k < len(truth) and proposal[k] == truth[k]:
        k += 1
    return k


def walk(accepted: dict[str, list[int]], arms: list[str], depth: int, total: int) -> tuple[int, list[list[str]]]:
    """Rounds to commit ``total`` tokens from position 1 when each round commits the longest
    of ``arms``' accepted runs (capped at ``depth``) plus the bonus; also which arms reached
    that longest run each round (pure). ``accepted[arm][i]``: the run from position i."""
    position, rounds, winners = 1, 0, []
    while position < total:
        runs = {arm: min(accepted[arm][position], depth) for arm in arms}
        best = max(runs.values())
        winners.append([arm for arm in arms if runs[arm] == best])
        position += best + 1
        rounds += 1
    return rounds, winners


def chain_runs(decoder, ids: list[int], gen: list[int], depth: int) -> list[int]:
    """The drafter's greedy chain of ``depth`` tokens proposed after each committed prefix
    ids + gen[:i] (i >= 1), as its accepted run against gen[i:] (index 0 unused)."""
    text = ids + gen
    cache = decoder.new_cache(len(text) + depth + 2)
    decoder(torch.tensor(text[: len(ids)]), torch.arange(len(ids)), cache)
    runs = [0]
    for i in range(1, len(gen)):
        root_at = len(ids) + i - 1  # the cache holds text[:root_at]; the root is text[root_at]
        feed, proposed = text[root_at], []
        for j in range(depth):
            feed = int(decoder(torch.tensor([feed]), torch.tensor([root_at + j]), cache)[-1].argmax())
            proposed.append(feed)
        cache.truncate(root_at + 1)
        runs.append(accepted_run(proposed, gen[i:]))
    cache.release()
    return runs


def step_ms(decoder, context: int, rows: int, repeats: int = 7) -> float:
    """Median ms of one forward of ``rows`` new tokens after ``context`` cached ones."""
    cache = decoder.new_cache(context + rows + 1)
    decoder(torch.zeros(context, dtype=torch.long), torch.arange(context), cache)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        decoder(torch.zeros(rows, dtype=torch.long), torch.arange(context, context + rows), cache)
        times.append(1000 * (time.perf_counter() - start))
        cache.truncate(context)
    cache.release()
    return statistics.median(times)


def policy_row(tokens: int, rounds: int, one_device_ms: float, device_each_ms: float, kind_rounds: dict) -> dict:
    mal = tokens / rounds
    return {"mal": round(mal, 3), "rounds": rounds, "tokens": tokens,
            "one_device_tok_s": round(1000 * mal / one_device_ms, 3),
            "device_each_tok_s": round(1000 * mal / device_each_ms, 3),
            "mal_per_kind": {kind: round(t / r, 2) for kind, (r, t) in sorted(kind_rounds.items())}}


def summarise(per_prompt: list[dict], drafters: list[str], depth: int, timing: dict) -> dict:
    """Mean accepted length and modelled tokens/s of each single drafter, each pair fused,
    all fused, and the oracle router (pure)."""
    arms = [f"ngram@{depth}" if name == "ngram" else name for name in drafters]
    draft_ms = {arm: depth * timing["draft_ms"].get(arm, 0.0) for arm in arms}  # the n-gram lookup: free
    verify_ms = timing["verify_ms"]
    groups = {arm: [arm] for arm in arms}
    groups |= {f"{a} + {b}": [a, b] for i, a in enumerate(arms) for b in arms[i + 1:]}
    if len(arms) > 2:
        groups["all fused"] = arms
    out = {}
    for name, group in [*groups.items(), ("oracle router", arms)]:
        rounds = tokens = 0
        spent = 0.0
        kind_rounds: dict[str, list[int]] = {}
        for prompt in per_prompt:
            n, winners = walk(prompt["accepted"], group, depth, prompt["tokens"])
            rounds, tokens = rounds + n, tokens + prompt["tokens"] - 1
            spent += sum(min(draft_ms[arm] for arm in won) for won in winners) + n * verify_ms[depth + 1]
            counts = kind_rounds.setdefault(prompt["kind"], [0, 0])
            counts[0], counts[1] = counts[0] + n, counts[1] + prompt["tokens"] - 1
        if name == "oracle router":
            out[name] = policy_row(tokens, rounds, spent / rounds, spent / rounds, kind_rounds)
            continue
        verify = verify_ms[len(group) * depth + 1]
        one_device = sum(draft_ms[arm] for arm in group) + verify
        device_each = max(draft_ms[arm] for arm in group) + verify
        out[name] = policy_row(tokens, rounds, one_device, device_each, kind_rounds)
    for cost in ("one_device", "device_each"):
        best = max(out[arm][f"{cost}_tok_s"] for arm in arms)
        for row in out.values():
            row[f"{cost}_vs_best"] = round(row[f"{cost}_tok_s"] / best, 3)
    ar = 1000 / verify_ms[1]
    for row in out.values():
        row["one_device_vs_ar"] = round(row["one_device_tok_s"] / ar, 3)
    return out


def render(report: dict) -> None:
    console = Console(width=200)
    for depth, rows in report["depths"].items():
        kinds = sorted(next(iter(rows.values()))["mal_per_kind"])
        table = Table(title=f"depth {depth}: mean accepted length, modelled tokens/s (x the best single drafter)")
        for column in ("policy", "MAL", *[f"MAL {k}" for k in kinds], "one device", "a device each", "one device vs ar"):
            table.add_column(column, justify="left" if column == "policy" else "right")
        for name, row in rows.items():
            table.add_row(name, f"{row['mal']:.2f}", *[f"{row['mal_per_kind'][k]:.2f}" for k in kinds],
                          f"{row['one_device_tok_s']:.2f} ({row['one_device_vs_best']:.2f}x)",
                          f"{row['device_each_tok_s']:.2f} ({row['device_each_vs_best']:.2f}x)",
                          f"{row['one_device_vs_ar']:.2f}x")
        console.print(table)
    timing = report["timing"]
    console.print(f"timing (ms, context {timing['context']}): draft step {timing['draft_ms']}, "
                  f"target forward by rows {timing['verify_ms']}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--drafters", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b@20,ngram")
    parser.add_argument("--prompts", default="mixed")
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--depths", default="4,6,10")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--draft-quant", default="int8")
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    config = build_config(None, dtype=args.dtype, threads=2, draft_quant=args.draft_quant, mode="multi",
                          drafters=args.drafters)
    apply_threads(config)
    console = Console(stderr=True)
    target = load_named(config.target, config, console, target=True)
    models = {name: load_named(name, config, console, config.draft_quant).decoder
              for name in config.drafter_names if name != "ngram"}
    per_prompt = []
    prompts = load_prompts(args.prompts)[: args.limit or None]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("prompts", total=len(prompts))
        for prompt in prompts:
            ids = encode_user_text(target.tokenizer, prompt.prompt, prompt.chat)
            gen, _, _ = generate(target.decoder, ids, SamplingParams(max_tokens=args.tokens),
                                 eos_token_ids=target.eos_token_ids)
            accepted = {name: chain_runs(model, ids, gen, max(depths)) for name, model in models.items()}
            if "ngram" in config.drafter_names:
                for d in depths:  # the lookup's proposal depends on its depth
                    lookup = NgramDrafter(d)
                    accepted[f"ngram@{d}"] = [0] + [accepted_run(lookup.lookup(ids + gen[:i]), gen[i:])
                                                    for i in range(1, len(gen))]
            per_prompt.append({"kind": prompt.kind, "prompt_tokens": len(ids), "tokens": len(gen), "accepted": accepted})
            progress.advance(task)
    context = int(statistics.median(p["prompt_tokens"] + p["tokens"] // 2 for p in per_prompt))
    verify_rows = sorted({1, *(k * d + 1 for d in depths for k in range(1, len(config.drafter_names) + 1))})
    timing = {"context": context,
              "draft_ms": {name: step_ms(model, context, 1) for name, model in models.items()},
              "verify_ms": {rows: step_ms(target.decoder, context, rows) for rows in verify_rows}}
    report = {"settings": vars(args), "timing": timing, "per_prompt": per_prompt,
              "depths": {d: summarise(per_prompt, config.drafter_names, d, timing) for d in depths}}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    render(report)


if __name__ == "__main__":
    main()
