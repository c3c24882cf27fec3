"""Pre-speculation's decisions as pure functions (SSD / Saguaro, DESIGN §4).

P(k)      = p_1..p_k (1-p_{k+1}) for k < d,        how many of d drafted tokens the target accepts,
            p_1..p_d for k = d                     p_i = P(position i accepted | i - 1 were), measured
                                                   per session (geometric, p_i = a, before it has rounds)
P(v)      = reach(v) (1 - Σ_c a_c)                 a tree: the accepted path ends at node v, where
                                                   a_c = a q(c) / max q(siblings) (a chain: P(k))
F_k       ∝ P(k)^(1/(1+r)),  Σ F_k = B            geometric fan-out (Theorem 12), capped per position
1-hit(F)  = F^(-r)                                 the power-law miss rate r is fitted to
speedup   = (h·E_p + (1-h)·E_b) / (h + (1-h)(1+T_b))   over autoregressive (Theorem 7), times in
                                                       units of one verification
budget    = argmax_B hit(B)·f(B)·(d+1)·t(w) - t(rows)/2   a partly drafted hit still saves its share f(B)
fallback  = the backup (n-gram) when E_b/Z beats E_p/(Z + d·t_step(m)) for the m misses drafted together
            (Theorem 17's cross-over, from measured times)
answer    = a partly drafted hit with its j tokens (levels) now when E(j)/Z beats E(d)/(Z + (d-j)·t_step),
            E(n) = 1 + Σ_{i<=n} p_1..p_i"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Sequence

MIN_OUTCOMES_FOR_FIT = 8  # below this, the prior exponent stands
PRIOR_R = 1.0
PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 4.0  # the prior counts as this many drafted tokens


def outcome_probs(a: float, depth: int) -> list[float]:
    """P(k accepted) for k = 0..depth, geometric in the acceptance rate a."""
    if not 0.0 <= a <= 1.0 or depth < 1:
        raise ValueError(f"need 0 <= a <= 1 and depth >= 1, got a={a}, depth={depth}")
    return chain_outcome_probs([a] * depth)


def acceptance_by_position(rounds: Sequence[tuple[int, int]], depth: int, a: float) -> list[float]:
    """p_i = P(position i accepted | the i - 1 before it were), i = 1..depth, from a session's
    rounds (tokens or levels proposed, accepted), each pulled towards a prior while few rounds
    reached it: the session's rate a for position 1, p_{i-1} for the others. A round whose
    proposal stopped short of i says nothing about i.
    Why not a alone: acceptance runs in streaks (text the draft knows well is accepted whole), so
    a geometric P(k) in a = accepted/drafted puts 6 % on a full accept where 34 % is measured
    (Qwen2.5-Coder 0.5B -> 1.5B, d = 4, held-out prompts), and undervalues deeper proposals. Why
    p_{i-1} as the prior: in streaks p_i grows with i (0.71, 0.75, 0.77, 0.82 there), and a
    session answered with short proposals rarely reaches its deeper positions; pulled towards a,
    they would look worse than they are, and proposals would shorten further."""
    if not 0.0 <= a <= 1.0 or depth < 1:
        raise ValueError(f"need 0 <= a <= 1 and depth >= 1, got a={a}, depth={depth}")
    p: list[float] = []
    for i in range(1, depth + 1):
        reached = sum(1 for n, k in rounds if n >= i and k >= i - 1)
        accepted = sum(1 for n, k in rounds if n >= i and k >= i)
        prior = p[-1] if p else a
        p.append(min(max((accepted + prior * PRIOR_WEIGHT) / (reached + PRIOR_WEIGHT), 0.01), 0.99))
    return p


def chain_outcome_probs(p: Sequence[float]) -> list[float]:
    """P(k accepted) for k = 0..len(p), from the acceptance by position (``acceptance_by_position``)."""
    if not p or not all(0.0 <= x <= 1.0 for x in p):
        raise ValueError(f"need one acceptance in [0, 1] per position, got {list(p)}")
    out, reach = [], 1.0
    for x in p:
        out.append(reach * (1 - x))
        reach *= x
    return out + [reach]


def tree_outcome_probs(a: float, parents: Sequence[int], probs: Sequence[float]) -> list[float]:
    """P(the accepted path ends at node v) for each node of a proposal tree (BFS order, node 0
    the root). A node's likeliest child is accepted with the session's acceptance rate a, its
    siblings in proportion to their draft probability q (at most 0.99 for all of them); what
    a node does not pass to its children ends there. A chain gives ``outcome_probs``."""
    if not 0.0 <= a <= 1.0 or not parents or len(parents) != len(probs):
        raise ValueError(f"need 0 <= a <= 1 and one probability per node, got a={a}, {len(parents)} parents, "
                         f"{len(probs)} probabilities")
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents[1:], 1):
        children[parent].append(node)
    accept = [0.0] * len(parents)
    for kids in children:
        if kids:
            top = max(probs[c] for c in kids)
            shares = [a * probs[c] / top if top > 0 else 0.0 for c in kids]
            scale = min(1.0, 0.99 / sum(shares)) if len(kids) > 1 and sum(shares) > 0.99 else 1.0
            for c, share in zip(kids, shares):
                accept[c] = share * scale
    reach = [1.0] + [0.0] * (len(parents) - 1)
    for node in range(1, len(parents)):
        reach[node] = reach[parents[node]] * accept[node]
    return [reach[v] * (1.0 - sum(accept[c] for c in children[v])) for v in range(len(parents))]


def fanout(a: float, r: float, depth: int, budget: int, cap: int) -> list[int]:
    """Integer fan-outs F_0..F_d for a chain of depth d (``fanout_for`` its outcome probabilities)."""
    return fanout_for(outcome_probs(a, depth), r, budget, cap)


def fanout_for(outcomes: Sequence[float], r: float, budget: int, cap: int) -> list[int]:
    """Integer fan-outs, one per outcome, with Σ F = min(budget, cap·outcomes), F <= cap, in
    proportion to P^(1/(1+r)): the shares of capped outcomes go to the others (water-filling),
    then the largest remainders are rounded up."""
    if budget < 0 or cap < 0 or r < 0:
        raise ValueError(f"need budget, cap, r >= 0, got {budget}, {cap}, {r}")
    weights = [max(p, 0.0) ** (1.0 / (1.0 + r)) for p in outcomes]
    n = len(weights)
    total = min(budget, cap * n)
    shares = [0.0] * n
    free, left = set(range(n)), float(total)
    while free and left > 1e-9:
        mass = sum(weights[k] for k in free)
        if mass <= 0:
            for k in free:
                shares[k] += left / len(free)
            break
        over = {k for k in free if shares[k] + left * weights[k] / mass > cap}
        if not over:
            for k in free:
                shares[k] += left * weights[k] / mass
            break
        for k in over:
            left -= cap - shares[k]
            shares[k] = cap
        free -= over
    counts = [min(cap, math.floor(s + 1e-9)) for s in shares]
    order = sorted(range(n), key=lambda k: (counts[k] - shares[k], k))
    for k in order[: total - sum(counts)]:
        counts[k] += 1
    return counts


def acceptance_estimate(accepted: int, drafted: int) -> float:
    """The session's acceptance rate, pulled towards a prior while it has drafted little."""
    a = (accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (drafted + PRIOR_WEIGHT)
    return min(max(a, 0.01), 0.99)


def power_law_exponent(ranks: Sequence[int | None], max_fanout: int) -> float:
    """Fit 1-hit(F) = F^(-r) to observed outcomes: ``ranks`` holds, per residual bonus, its
    0-based rank among the draft's candidates at that position (the proposed token
    excluded), None when it was not among them. Least squares through the origin in
    log-log space over F = 2..max_fanout; the prior while there are few outcomes."""
    if len(ranks) < MIN_OUTCOMES_FOR_FIT or max_fanout < 2:
        return PRIOR_R
    xs, ys = [], []
    for f in range(2, max_fanout + 1):
        miss = sum(1 for rank in ranks if rank is None or rank >= f) / len(ranks)
        if 0.0 < miss < 1.0:
            xs.append(math.log(f))
            ys.append(math.log(miss))
    if not xs:  # every bonus in the top 2 (never missed), or never in the top max_fanout
        return 8.0 if all(rank is not None and rank < 2 for rank in ranks) else 0.05
    r = -sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return min(max(r, 0.05), 8.0)


def step_time_fit(samples: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares t(rows) = alpha + beta·rows over measured (rows, seconds) steps, or None
    while the rows measured do not vary (beta then has no estimate)."""
    if len(samples) < 2:
        return None
    n = len(samples)
    mean_x = sum(x for x, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in samples)
    if sxx == 0:
        return None
    beta = max(sum((x - mean_x) * (y - mean_y) for x, y in samples) / sxx, 1e-9)
    return max(mean_y - beta * mean_x, 0.0), beta


CARRY_SHARE = 0.1  # carried rows may add this share to a forward's time


def carry_is_cheap(fit: tuple[float, float] | None, rows_own: int, rows_carried: int) -> bool:
    """Let a forward that drafts some sessions' next proposals (a miss, a hit still being
    drafted) carry other sessions' branch rows too? Where the measured step time t(rows) =
    alpha + beta·rows says they add at most CARRY_SHARE to it: a GPU-like draft, whose rows are
    nearly free. There the other plans keep advancing instead of waiting for the compute thread:
    at N >= 2 a miss drafted alone held it through the other session's verification, whose plan
    then missed too (trees: hit rate 85 % at N = 1, 11-40 % at N >= 2)."""
    if fit is None or rows_carried <= 0:
        return False
    alpha, beta = fit
    return beta * rows_carried <= CARRY_SHARE * (alpha + beta * max(rows_own, 1))


def budget_that_fits(return_s: float, depth: int, fit: tuple[float, float], sharing: int, most: int,
                     rows_per_branch: int = 1) -> int:
    """Branches one session can have drafted before its outcome returns (SSD's budget: what the
    draft finishes while the target verifies): d+1 steps of t(rows) within the return time Z,
    the rows shared among ``sharing`` sessions, a branch feeding ``rows_per_branch`` rows a step
    (1 for a chain, up to the width for a tree); at least 1, at most ``most``."""
    alpha, beta = fit
    per_step = return_s / (depth + 1)
    rows = (per_step - alpha) / beta / max(sharing, 1) / max(rows_per_branch, 1)
    return int(min(max(math.floor(rows + 1e-9), 1), most))


def hit_curve(ranks: Sequence[int | None]) -> Callable[[int], float]:
    """H(F): the share of the session's past bonuses that ranked below F among the draft's
    candidates (None: not among them). Sorted once, asked for many fan-outs."""
    ranked, total = sorted(rank for rank in ranks if rank is not None), len(ranks)
    return lambda fanout: bisect.bisect_left(ranked, fanout) / total if total else 0.0


def expected_hit(outcomes: Sequence[float], fanouts: Sequence[int], hit: Callable[[int], float]) -> float:
    """Σ_v P(v)·H(F_v): the chance that the outcome is among the planned branches (H: ``hit_curve``)."""
    if len(outcomes) != len(fanouts):
        raise ValueError(f"need one fan-out per outcome, got {len(outcomes)} outcomes and {len(fanouts)} fan-outs")
    return sum(p * hit(f) for p, f in zip(outcomes, fanouts))


def budget_that_pays(return_s: float, depth: int, fit: tuple[float, float], sharing: int, most: int,
                     hit_at: Callable[[int], float], rows_per_branch: int = 1) -> int:
    """The budget B in 1..most that saves the session the most drafting time per round.

    A hit branch is adopted even when it is only partly drafted (the session drafts the rest), so
    a hit on a branch that got the share f(B) = min(1, Z / ((d+1)·t(rows))) of its d+1 steps saves
    that share of a just-in-time proposal, (d+1)·t(w); more rows per background step also make a
    real request wait longer behind one (half a step on average):
        saved(B) = hit(B)·f(B)·(d+1)·t(w) - t(rows)/2,   rows = B·w·sharing.
    Where batching is nearly free (a GPU) this is the largest budget; where a step of eight rows
    costs much more than one (a CPU), fewer — but not only what finishes (``budget_that_fits``)."""
    if most < 1:
        raise ValueError(f"need most >= 1, got {most}")
    alpha, beta = fit
    width = max(rows_per_branch, 1)
    just_in_time = (depth + 1) * (alpha + beta * width)
    best, best_saved = 1, -math.inf
    for budget in range(1, most + 1):
        step = alpha + beta * budget * width * max(sharing, 1)
        share = min(1.0, return_s / ((depth + 1) * step)) if step > 0 else 1.0
        saved = hit_at(budget) * share * just_in_time - step / 2
        if saved > best_saved + 1e-12:
            best, best_saved = budget, saved
    return best


def choose_fallback(misses: int, step_s: float, depth: int, return_s: float, e_primary: float,
                    e_backup: float) -> str:
    """"jit" (draft the missed proposals now with the primary draft) or "ngram" (the backup:
    no draft time, fewer tokens), whichever gives more tokens per second to the ``misses``
    sessions drafted together: E_p / (Z + d·t_step(m)) against E_b / Z."""
    if misses < 1:
        raise ValueError("choose_fallback needs at least one miss")
    z = max(return_s, 1e-6)
    jit = e_primary / (z + depth * max(step_s, 0.0))
    return "ngram" if e_backup / z > jit else "jit"


def predicted_speedup(hit: float, e_primary: float, e_backup: float, t_backup: float, t_primary: float = 0.0) -> float:
    """SSD's speedup over autoregressive decoding (Theorem 7); times in verifications. SSD assumes
    the primary's drafting ends within the verification (T_p <= 1, its appendix A); past that a
    hit still waits for the draft, so a hit's round takes max(1, T_p) here (the same for T_p <= 1)."""
    return (hit * e_primary + (1 - hit) * e_backup) / (hit * max(1.0, t_primary) + (1 - hit) * (1 + t_backup))


def predicted_gain_over_plain(hit: float, e_primary: float, t_primary: float) -> float:
    """Pre-speculation with a just-in-time fallback (E_b = E_p, T_b = T_p) over plain
    speculative decoding, whose speedup over autoregressive is E_p / (1 + T_p)."""
    return predicted_speedup(hit, e_primary, e_primary, t_primary, t_primary) / (e_primary / (1 + t_primary))


def expected_committed(p: Sequence[float], drafted: int) -> float:
    """Tokens a round commits on average when the target verifies a chain of ``drafted``
    tokens with acceptance p_i by position: the accepted ones and the bonus, 1 + Σ_{i<=n} p_1..p_i."""
    if not 0 <= drafted <= len(p) or not all(0.0 <= x <= 1.0 for x in p):
        raise ValueError(f"need 0 <= drafted <= {len(p)} and each acceptance in [0, 1], got drafted={drafted}, "
                         f"p={list(p)}")
    total, reach = 1.0, 1.0
    for x in p[:drafted]:
        reach *= x
        total += reach
    return total


def answer_now(drafted: int, depth: int, p: Sequence[float], return_s: float, step_s: float) -> bool:
    """Answer a hit whose branch holds ``drafted`` of its ``depth`` tokens (a tree: levels) with
    those now, rather than drafting the rest first (one step of ``step_s`` each)? Whichever round
    commits more tokens a second: E(j)/Z against E(d)/(Z + (d - j)·t_step), Z the return time,
    p the session's acceptance by position.
    The likeliest outcome, all d accepted, has its branches start a step late (the proposal's
    last token is fed first for their candidates), so at Z about the drafting time they come
    one step short; waiting a step for one more token of a round rarely pays."""
    if not 1 <= drafted <= depth <= len(p) or return_s <= 0 or step_s < 0:
        raise ValueError(f"need 1 <= drafted <= depth <= {len(p)} and return_s > 0, step_s >= 0, got drafted={drafted}, "
                         f"depth={depth}, return_s={return_s}, step_s={step_s}")
    now = expected_committed(p, drafted) / return_s
    later = expected_committed(p, depth) / (return_s + (depth - drafted) * step_s)
    return now > later
