"""Prometheus metrics of the gateway, in its own registry. The spec-decode counters use
the names vLLM and llama.cpp use, under a ``specctl:`` prefix; the gauges mirror the
latest stats snapshot of every role."""

from __future__ import annotations

import math
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "specctl:"
RECENT_GENERATIONS = 100  # the monitor's latency line: percentiles over the last this many generations
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)

# stats key of a role's snapshot -> (gauge name, help)
ROLE_GAUGES = {
    "load": ("draft_load", "fraction of wall time the role's compute thread is busy"),
    "T_idle_ms": ("T_idle_ms", "mean idle gap of the compute loop per pass (ms)"),
    "T_wait_ms": ("T_wait_ms", "mean time a request waits in the compute queue (ms)"),
    "t_s_ms": ("t_s_ms", "mean compute time per request (ms)"),
    "queue_depth": ("queue_depth", "requests waiting for the compute thread"),
    "sessions": ("sessions", "open sessions"),
    "prefill_sessions": ("prefill_sessions", "a target's sessions still reading their prompt"),
    "prefill_tokens_left": ("prefill_tokens_left", "prompt tokens a target has still to read (its sessions')"),
    "tokens_per_s": ("tokens_per_s", "tokens per second since start"),
    "R_q": ("R_q", "draft rounds per second"),
    "R_p": ("R_p", "verification rounds per second"),
    "load_rounds": ("load_rounds", "a target's plain rounds by choice: it ran more sessions than its "
                    "spec_max_sessions (spec.turns)"),
    "spec_depth_cap": ("spec_depth_cap", "the deepest proposal a target's load pays for now, learnt from its rounds "
                       "(spec_depth_by_load auto): 0 the draft's own depth, -1 plain rounds"),
    "specpipe_flushes": ("specpipe_flushes", "SpecPipe steps whose verified token was not in the tree (a refill)"),
    "specpipe_hit_rate": ("specpipe_hit_rate", "share of SpecPipe steps whose verified token was in the tree"),
    "specpipe_draft_lost": ("specpipe_draft_lost", "SpecPipe sessions that went on without their draft (plain PP) "
                                                   "for a while"),
    "specpipe_draft_reopened": ("specpipe_draft_reopened", "SpecPipe level sessions opened again after the draft "
                                                           "went away"),
    "specpipe_levels_dropped": ("specpipe_levels_dropped",
                                "SpecPipe levels in flight that verifications left dead (dropped by the stages)"),
    "specpipe_refill_tokens": ("specpipe_refill_tokens", "SpecPipe tokens decided by a refill's output after its "
                               "first (several levels sent with the verified token after a miss)"),
    "levels_sent": ("specpipe_levels_sent", "SpecPipe tree levels a draft server drafted for remote stage 1s"),
    "level_sessions": ("specpipe_level_sessions", "SpecPipe tree-level sessions open on a draft server"),
    "level_grafts": ("specpipe_level_grafts", "requests' predicted chains a draft server hung on SpecPipe trees"),
    "specpipe_predicted": ("specpipe_predicted", "nodes of requests' predicted chains SpecPipe sent through the stages"),
    "proposal_bytes_mean": ("proposal_bytes_mean", "mean size of a draft server's Proposal frame (bytes)"),
    "background_delay_max_ms": ("background_delay_max_ms", "longest a request waited for background work (ms)"),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "share of prompt tokens a role's prefix cache served"),
    "prefix_cache_hit_tokens": ("prefix_cache_hit_tokens", "prompt tokens a role's prefix cache served"),
    "prefix_cache_query_tokens": ("prefix_cache_query_tokens", "prompt tokens a role's prefix cache was asked for"),
    "prefix_cache_mb": ("prefix_cache_mb", "memory a role's prefix cache holds (MiB)"),
    "shared_prefills": ("shared_prefills", "prefills that waited for another session's with the same start and "
                        "restored it (engine.prefill_gate; one count a prefix cache, as its other figures)"),
}

# a draft server's "prespec" stats -> (gauge name, help)
PRESPEC_GAUGES = {
    "hit_rate": ("prespec_hit_rate", "share of outcomes whose next proposal was pre-speculated"),
    "ready_rate": ("prespec_ready_rate", "share of outcomes' next proposals drafted ahead, partial hits by the "
                   "share drafted"),
    "hits": ("prespec_hits", "outcomes answered from the speculation cache"),
    "misses": ("prespec_misses", "outcomes the speculation cache did not hold"),
    "partial_hits": ("prespec_partial_hits", "hits whose branch was still being drafted"),
    "short_answers": ("prespec_short_answers", "partial hits answered at once with the tokens drafted so far"),
    "branches_drafted": ("prespec_branches_drafted", "outcome branches planned for pre-speculation"),
    "branches_used": ("prespec_branches_used", "pre-speculated branches that became proposals"),
    "leftover_used": ("prespec_leftover_used", "share of the draft's idle time spent pre-speculating"),
}

STAGE_GAUGES = {
    "step_ms": ("stage_step_ms", "mean compute time of a pipeline stage per micro-batch (ms)"),
    "forwards": ("stage_forwards", "micro-batches a pipeline stage has run"),
    "pruned_positions": ("stage_pruned_positions", "KV positions a pipeline stage dropped after verifications"),
    "dropped_forwards": ("stage_dropped_forwards", "dead forwards a pipeline stage passed on without computing"),
    "skipped_rows": ("stage_skipped_rows", "dead rows of live forwards a pipeline stage did not compute"),
    "kv_used_mb": ("stage_kv_used_mb", "KV memory a pipeline stage holds (MiB)"),
}


# a target's "drafters" stats (several drafters) -> (gauge name, help), labelled by drafter
DRAFTER_GAUGES = {
    "chosen_rounds": ("drafter_chosen_rounds", "rounds a drafter was routed to"),
    "accepted_tokens": ("drafter_accepted_tokens", "a drafter's tokens the target accepted"),
    "failures": ("drafter_failures", "rounds a drafter was skipped: down, failed or past the deadline"),
    "mean_score": ("drafter_mean_score", "a drafter's mean routing score over finished sessions"),
    "benched": ("drafter_benched", "1 while a draft server sits rounds out, past the deadline round after round"),
}


def nearest_rank(ordered: list[float], percent: int) -> float | None:
    """The percent-th percentile of sorted values by nearest rank (a value that was measured)."""
    return ordered[max(0, math.ceil(percent / 100 * len(ordered)) - 1)] if ordered else None


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, p = self.registry, PREFIX
        self.drafts = Counter(f"{p}spec_decode_num_drafts", "speculative rounds verified", registry=r)
        self.draft_tokens = Counter(f"{p}spec_decode_num_draft_tokens", "draft tokens proposed (depth per round)", registry=r)
        self.accepted = Counter(f"{p}spec_decode_num_accepted_tokens", "draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter(f"{p}spec_decode_num_accepted_tokens_per_pos",
                                        "draft tokens accepted at each position", ["position"], registry=r)
        self.prediction_accepted = Counter(f"{p}prediction_accepted_tokens", "tokens drafted from requests' "
                                           "predictions (Predicted Outputs) that verification accepted", registry=r)
        self.prediction_rejected = Counter(f"{p}prediction_rejected_tokens", "tokens drafted from requests' "
                                           "predictions that verification rejected", registry=r)
        self.requests = Counter(f"{p}requests", "HTTP generation requests by outcome", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter(f"{p}generation_tokens", "tokens generated", registry=r)
        self.resumed_generations = Counter(f"{p}resumed_generations", "generations another target instance went "
                                           "on with after theirs was lost mid-stream", registry=r)
        self.running = Gauge(f"{p}requests_running", "requests in flight through this gateway", registry=r)
        self.waiting = Gauge(f"{p}requests_waiting", "generations waiting for a free session (every target "
                             "instance up at capacity)", registry=r)
        # vLLM's latency histograms (its buckets), one observation a generation (a request's choice)
        self.time_to_first_token = Histogram(
            f"{p}time_to_first_token_seconds", "time from a request's arrival to a generation's first token",
            buckets=TTFT_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            f"{p}time_per_output_token_seconds", "a generation's time per token after its first",
            buckets=TPOT_BUCKETS, registry=r)
        self.e2e_latency = Histogram(f"{p}e2e_request_latency_seconds",
                                     "time from a request's arrival to a generation's end", buckets=E2E_BUCKETS,
                                     registry=r)
        self.queue_time = Histogram(f"{p}request_queue_time_seconds",
                                    "time a generation waited for a free session (gateway.waiting; 0 when one was "
                                    "free)", buckets=E2E_BUCKETS, registry=r)
        self.recent: deque[tuple[float | None, float | None, float]] = deque(maxlen=RECENT_GENERATIONS)
        self.role_up = Gauge(f"{p}role_up", "1 when the role answered the last poll", ["role", "address"], registry=r)
        self.role_gauges = {key: Gauge(f"{p}{name}", help_, ["role", "address"], registry=r)
                            for key, (name, help_) in ROLE_GAUGES.items()}
        self.stage_gauges = {key: Gauge(f"{p}{name}", help_, ["address", "stage"], registry=r)
                             for key, (name, help_) in STAGE_GAUGES.items()}
        self.prespec_gauges = {key: Gauge(f"{p}{name}", help_, ["address"], registry=r)
                               for key, (name, help_) in PRESPEC_GAUGES.items()}
        self.prespec_fallbacks = Gauge(f"{p}prespec_fallbacks", "cache misses by how they were drafted",
                                       ["address", "kind"], registry=r)
        self.drafter_gauges = {key: Gauge(f"{p}{name}", help_, ["address", "drafter"], registry=r)
                               for key, (name, help_) in DRAFTER_GAUGES.items()}

    def record_generation(self, stats: dict) -> None:
        """Counters from a finished request's per-session statistics."""
        self.drafts.inc(stats.get("rounds", 0))
        self.draft_tokens.inc(stats.get("drafted", 0))
        self.accepted.inc(stats.get("accepted", 0))
        for position, count in enumerate(stats.get("accepted_per_pos", [])):
            self.accepted_per_pos.labels(position=str(position)).inc(count)
        self.prediction_accepted.inc(stats.get("prediction_accepted", 0))
        self.prediction_rejected.inc(stats.get("prediction_rejected", 0))

    def record_latency(self, arrival: float, first: float | None, end: float, tokens: int) -> None:
        """A finished generation's latencies (time.perf_counter() seconds): first None when no
        token came."""
        ttft = None if first is None else first - arrival
        tpot = (end - first) / (tokens - 1) if first is not None and tokens > 1 else None
        if ttft is not None:
            self.time_to_first_token.observe(ttft)
        if tpot is not None:
            self.time_per_output_token.observe(tpot)
        self.e2e_latency.observe(end - arrival)
        self.recent.append((ttft, tpot, end - arrival))

    def resumed_count(self) -> int:
        """Generations another instance went on with so far (the stats feed's)."""
        return int(self.registry.get_sample_value(f"{PREFIX}resumed_generations_total") or 0)

    def latency_summary(self) -> dict:
        """The stats feed's latency figures (ms; None where no generation measured one): p50 and
        p90 of time to first token, time per output token and end to end over the last
        RECENT_GENERATIONS generations — what the histograms give Prometheus, for the monitor."""
        summary: dict = {"generations": len(self.recent)}
        for i, name in enumerate(("ttft", "tpot", "e2e")):
            values = sorted(r[i] * 1000 for r in self.recent if r[i] is not None)
            for p in (50, 90):
                summary[f"{name}_ms_p{p}"] = nearest_rank(values, p)
        return summary

    def record_role(self, role: str, address: str, up: bool, stats: dict) -> None:
        self.role_up.labels(role=role, address=address).set(1 if up else 0)
        for key, gauge in self.role_gauges.items():
            if isinstance(stats.get(key), (int, float)):
                gauge.labels(role=role, address=address).set(stats[key])
        for stage in stats.get("stages", []):  # a pipelined target: its stages 2..n, by the address of stage 1
            for key, gauge in self.stage_gauges.items():
                if isinstance(stage.get(key), (int, float)):
                    gauge.labels(address=address, stage=str(stage.get("stage"))).set(stage[key])
        drafters = stats.get("drafters")
        if isinstance(drafters, dict):  # a target with several drafters, routed and fused
            for name, drafter in drafters.items():
                for key, gauge in self.drafter_gauges.items():
                    if isinstance(drafter, dict) and isinstance(drafter.get(key), (int, float)):
                        gauge.labels(address=address, drafter=name).set(drafter[key])
        prespec = stats.get("prespec")
        if isinstance(prespec, dict):  # a pre-speculating draft server
            for key, gauge in self.prespec_gauges.items():
                if isinstance(prespec.get(key), (int, float)):
                    gauge.labels(address=address).set(prespec[key])
            for kind in ("jit", "ngram"):
                if isinstance(prespec.get(f"fallback_{kind}"), int):
                    self.prespec_fallbacks.labels(address=address, kind=kind).set(prespec[f"fallback_{kind}"])

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
