"""How often pre-speculation *could* hit, with every branch drafted in time: the hit-rate ceiling
of a draft/target pair, per budget and depth, and SSD's gain over plain speculation it allows.

    python examples/prespec_hit_ceiling.py OUT.json [--limit N] [--tokens N] [--depths 3,4,6]

A hit needs the round's outcome — k of d drafted tokens accepted, then the target's bonus b —
to be among the outcomes drafted ahead. Which outcomes are drafted is the draft server's own
policy (`specctl/draft/fanout.py`: F_k ∝ P(k)^(1/(1+r)), a and r estimated online per session,
at most 16 candidates per k), so the ceiling here is what that policy reaches with no time
limit: the draft server's real hit rate can only be lower (a branch still unfinished when the
outcome returns is finished first; one never started is a miss). Greedy, chain proposals,
Qwen2.5-Coder 0.5B -> 1.5B both int8 (as `bench prespec`), held-out prompts. The outcome and
the bonus's rank among the draft's candidates do not depend on timing, so one process
measures them; SSD's gain at Z = S is `fanout.predicted_gain_over_plain(h, E_p, 1)`."""
import argparse
import json
import statistics

import torch
from rich.console import Console

from specctl.bench.prompts import load_prompts
from specctl.config import build_config
from specctl.draft.fanout import acceptance_estimate, fanout, power_law_exponent, predicted_gain_over_plain
from specctl.spec.factory import apply_threads, load_named

CANDIDATES = 16  # the draft server's cap per outcome (candidates after excluding the proposed token)
BUDGETS = (1, 2, 4, 8, 16, 32, 64)

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--limit", type=int, default=20)
parser.add_argument("--tokens", type=int, default=48)
parser.add_argument("--depths", default="3,4,6")
args = parser.parse_args()
depths = [int(d) for d in args.depths.split(",")]

config = build_config(None, dtype="fp32", threads=2, draft_quant="int8", target_quant="int8")
apply_threads(config)
console = Console(stderr=True)
target_model = load_named(config.target, config, console, quant="int8", target=True)
target, tokenizer = target_model.decoder, target_model.tokenizer
draft = load_named(config.draft, config, console, quant="int8").decoder


def greedy(decoder, ids: list[int], n: int) -> list[int]:
    """The target's own greedy continuation (what every lossless mode outputs)."""
    cache = decoder.new_cache(len(ids) + n + 1)
    logits = decoder(torch.tensor(ids), torch.arange(len(ids)), cache, logits_at=torch.tensor([len(ids) - 1]))
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        pos = len(ids) + len(out) - 1
        out.append(int(decoder(torch.tensor(out[-1:]), torch.tensor([pos]), cache)[-1].argmax()))
    cache.release()
    return out


def rounds(ids: list[int], gen: list[int], depth: int) -> list[tuple[int, int | None]]:
    """Plain chain speculation over the target's text: per round (k accepted, the bonus's 0-based
    rank among the draft's candidates for it, None if not in the top CANDIDATES)."""
    cache = draft.new_cache(len(ids) + len(gen) + depth + 2)
    draft(torch.tensor(ids[:-1]), torch.arange(len(ids) - 1), cache)
    text, done, out = list(ids), 0, []
    while done < len(gen):
        feed, proposed, tops = text[-1], [], []
        for j in range(depth + 1):
            logits = draft(torch.tensor([feed]), torch.tensor([len(text) - 1 + j]), cache)[-1]
            top = logits.topk(CANDIDATES + 1).indices.tolist()
            tops.append(top)
            if j < depth:
                feed = top[0]
                proposed.append(feed)
        k = 0
        while k < depth and done + k < len(gen) and proposed[k] == gen[done + k]:
            k += 1
        if done + k >= len(gen):
            break
        bonus = gen[done + k]
        candidates = [t for t in tops[k] if k == depth or t != proposed[k]][:CANDIDATES]
        out.append((k, candidates.index(bonus) if bonus in candidates else None))
        cache.truncate(len(text) + k)
        text += proposed[:k] + [bonus]
        done += k + 1
    cache.release()
    return out


def online_hits(outcomes: list[tuple[int, int | None]], depth: int, budget: int) -> int:
    """Hits of the draft server's fan-out policy, estimating a and r from earlier rounds only."""
    hits, accepted, drafted, ranks = 0, 0, 0, []
    for k, rank in outcomes:
        a = acceptance_estimate(accepted, drafted)
        r = power_law_exponent(ranks, CANDIDATES)
        f = fanout(a, r, depth, budget, CANDIDATES)
        hits += rank is not None and rank < f[k]
        accepted, drafted = accepted + k, drafted + depth
        ranks.append(rank)
    return hits


prompts = load_prompts("heldout")[: args.limit]
rows = []
for i, prompt in enumerate(prompts):
    ids = tokenizer.encode(prompt.prompt)
    gen = greedy(target, ids, args.tokens)
    for depth in depths:
        outcomes = rounds(ids, gen, depth)
        row = {"prompt": i + 1, "kind": prompt.kind, "depth": depth, "rounds": len(outcomes),
               "tokens_per_round": round(sum(k + 1 for k, _ in outcomes) / len(outcomes), 3),
               "k": [k for k, _ in outcomes], "bonus_rank": [r for _, r in outcomes],
               "hit_rate": {b: round(online_hits(outcomes, depth, b) / len(outcomes), 4) for b in BUDGETS}}
        rows.append(row)
        console.print(f"prompt {i + 1} ({prompt.kind}) d={depth}: {row['rounds']} rounds, "
                      f"E_p {row['tokens_per_round']}, hit rate by budget {row['hit_rate']}")

summary = []
for depth in depths:
    mine = [r for r in rows if r["depth"] == depth]
    e_p = statistics.mean(r["tokens_per_round"] for r in mine)
    for budget in BUDGETS:
        hits = [r["hit_rate"][budget] for r in mine]
        pooled = sum(r["hit_rate"][budget] * r["rounds"] for r in mine) / sum(r["rounds"] for r in mine)
        summary.append({"depth": depth, "budget": budget, "E_p": round(e_p, 3),
                        "hit_min_median_max": [min(hits), statistics.median(hits), max(hits)],
                        "hit_pooled": round(pooled, 4),
                        "gain_over_plain_at_Z_eq_S": round(predicted_gain_over_plain(pooled, e_p, 1.0), 3)})
        print(summary[-1], flush=True)
json.dump({"pair": [config.draft, config.target], "quant": "int8", "tokens": args.tokens, "candidates": CANDIDATES,
           "rows": rows, "summary": summary}, open(args.out, "w"), indent=1)
