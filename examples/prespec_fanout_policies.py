"""The draft server's fan-out policy with P(k) geometric in the mean acceptance rate against P(k)
from the acceptance by position, replayed on the rounds `prespec_hit_ceiling.py` measured.

    python examples/prespec_fanout_policies.py [CEILING.json] [OUT.json]

A round's outcome (k accepted, the bonus's rank among the draft's candidates) does not depend on
the policy, so each policy's hit rate with every planned branch drafted in time is a replay:
per prompt, a, the acceptance by position and r are estimated from the earlier rounds only, as
the server does (`specctl/draft/speculation.py`)."""
import json
import sys

from specctl.draft.fanout import (
    acceptance_by_position, acceptance_estimate, chain_outcome_probs, fanout, fanout_for, power_law_exponent,
)

CANDIDATES = 16
source = sys.argv[1] if len(sys.argv) > 1 else "docs/results/prespec-hit-ceiling-heldout.json"
rows = json.load(open(source))["rows"]
summary = []
for depth in sorted({r["depth"] for r in rows}):
    for budget in (1, 2, 4, 8, 16, 32):
        rounds_total, hits = 0, {"geometric": 0, "by_position": 0}
        for row in (r for r in rows if r["depth"] == depth):
            accepted, drafted, ranks, seen = 0, 0, [], []
            for k, rank in zip(row["k"], row["bonus_rank"]):
                a = acceptance_estimate(accepted, drafted)
                r = power_law_exponent(ranks, CANDIDATES)
                plans = {"geometric": fanout(a, r, depth, budget, CANDIDATES),
                         "by_position": fanout_for(chain_outcome_probs(acceptance_by_position(seen, depth, a)), r,
                                                   budget, CANDIDATES)}
                for name, counts in plans.items():
                    hits[name] += rank is not None and rank < counts[k]
                accepted, drafted = accepted + k, drafted + depth
                ranks.append(rank)
                seen.append((depth, k))
                rounds_total += 1
        summary.append({"depth": depth, "budget": budget, "rounds": rounds_total,
                        **{f"hit_{name}": round(n / rounds_total, 4) for name, n in hits.items()}})
        print(f"d={depth} B={budget:2d}: hit rate geometric {hits['geometric'] / rounds_total:.1%}, "
              f"by position {hits['by_position'] / rounds_total:.1%}")
if len(sys.argv) > 2:
    json.dump({"source": source, "summary": summary}, open(sys.argv[2], "w"), indent=1)
