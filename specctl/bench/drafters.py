"""``specctl bench drafters``: each drafter alone, routing among them, and routing + fusion
(CoSine), greedy, on the same prompts in one run, against the target alone. Routing alone
asks one drafter a round: the top-scored one (an untried drafter counts as 0.5, so a weak
one is dropped for an untried one; the free n-gram lookup wins ties; a drafter with nothing
to propose passes the round to the next). Routing + fusion also adds a random other drafter
(often while the session accepts little, rarely once it accepts much) and the n-gram
lookup's match whenever it has one, and fuses the chains. Both may route a session to no
drafter (plain rounds) where its plain rounds commit faster, and let the drafter whose rounds
commit fastest on the session lead each round (``spec.pays``), each session starting from
the rates the earlier ones measured; "own rates" is routing + fusion with each session
measuring every arm itself, to show what sharing adds; the last mode is routing + fusion led
by the routing score alone (CoSine's rule, with the plain arm), to show what leading by the
measured rate adds."""

from __future__ import annotations

from rich.progress import Progress

from specctl.bench.local import drafter_runner, measure
from specctl.bench.prompts import BenchPrompt
from specctl.config import Config
from specctl.engine.loader import LoadedModel
from specctl.engine.text import encode_user_text
from specctl.spec.drafters import Drafter
from specctl.spec.multi import MultiDrafter
from specctl.spec.routing import RoutingPolicy

ROUTING_ONLY = RoutingPolicy(alpha=0.0, beta=0.0, free_riders=False)
BY_SCORE = "routing+fusion by score"
OWN_RATES = "routing+fusion, own rates"  # each session measures every arm itself (no pooled prior)
ROUTED = ("routing", "routing+fusion", OWN_RATES, BY_SCORE)


def run_drafters_bench(config: Config, target: LoadedModel, drafters: dict[str, Drafter], prompts: list[BenchPrompt],
                       max_tokens: int, progress: Progress, repeats: int = 1) -> dict:
    encoded = [encode_user_text(target.tokenizer, p.prompt, p.chat) for p in prompts]
    warm_up = encoded[0][:8]
    routing, fused = MultiDrafter(drafters, policy=ROUTING_ONLY), MultiDrafter(drafters)
    by_score = MultiDrafter(drafters, policy=RoutingPolicy(by_rate=False))
    own_rates = MultiDrafter(drafters, policy=RoutingPolicy(pooled=False))
    plan = {"ar": None, **drafters, "routing": routing, "routing+fusion": fused, OWN_RATES: own_rates,
            BY_SCORE: by_score}
    runners = {}
    for name, drafter in plan.items():
        progress.console.print(f"[dim]preparing {name}[/]")
        runners[name] = drafter_runner(drafter, target, max_tokens, warm_up)
    modes = measure(runners, encoded, [p.kind for p in prompts], progress, repeats)
    return {
        "settings": {"target": config.target, "draft": ",".join(drafters), "dtype": config.dtype,
                     "draft_quant": config.draft_quant, "max_tokens": max_tokens, "prompts": len(prompts),
                     "repeats": repeats, "depth": config.depth, "temperature": 0.0,
                     "tau": fused.policy.tau, "alpha": fused.policy.alpha, "beta": fused.policy.beta},
        "modes": modes,
        "drafters": {"routing": routing.snapshot(), "routing+fusion": fused.snapshot(),
                     OWN_RATES: own_rates.snapshot(), BY_SCORE: by_score.snapshot()},
        "against_best_single": against_best_single(modes, list(drafters)),
    }


def against_best_single(modes: dict, singles: list[str]) -> dict:
    """tokens/s of routing and routing + fusion over the best single drafter's, overall and per
    class of prompt (the best single drafter of that class)."""
    best = max(singles, key=lambda name: modes[name]["tokens_per_s"])
    kinds = sorted(modes[best]["per_kind"])
    out: dict = {"best_single": best}
    for mode in ROUTED:
        per_kind = {}
        for kind in kinds:
            top = max(modes[name]["per_kind"][kind]["tokens_per_s"] for name in singles)
            per_kind[kind] = round(modes[mode]["per_kind"][kind]["tokens_per_s"] / top, 3) if top else None
        overall = modes[best]["tokens_per_s"]
        out[mode] = {"overall": round(modes[mode]["tokens_per_s"] / overall, 3) if overall else None,
                     "per_kind": per_kind}
    # What routing could reach at most without fusing: every class served by its best single
    # drafter (and by the target alone where that is faster), over the best single overall.
    for key, arms in (("ceiling_best_per_class", singles), ("ceiling_best_per_class_or_ar", [*singles, "ar"])):
        rate = per_class_best_rate(modes, arms, kinds)
        out[key] = round(rate / overall, 3) if overall and rate else None
    return out


def per_class_best_rate(modes: dict, arms: list[str], kinds: list[str]) -> float:
    """tokens/s of the whole workload if each class ran on its fastest of ``arms`` (pure)."""
    tokens = seconds = 0.0
    for kind in kinds:
        rows = [modes[arm]["per_kind"][kind] for arm in arms if arm in modes]
        best = max(row["tokens_per_s"] for row in rows)
        if best <= 0:
            return 0.0
        count = rows[0]["new_tokens"]
        tokens, seconds = tokens + count, seconds + count / best
    return tokens / seconds if seconds else 0.0
