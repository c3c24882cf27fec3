"""What a target instance reports (the STATS reply: the gateway's /metrics and stats feed,
the monitor): its rounds and tokens, its draft link, pipeline, SpecPipe or drafters, and its
compute thread."""

from __future__ import annotations

import time

from specctl.engine.prefix_cache import prefix_cache_stats


def target_snapshot(server) -> dict:
    """``server``: a verify.server.TargetServer."""
    t, piped = server.totals, server.specpipe.totals if server.specpipe is not None else None
    wall = max(time.perf_counter() - server.started, 1e-9)
    stats = {
        "model": server.model.name, "sessions": server.active, "sessions_done": server.sessions_done,
        "rounds": t.rounds, "R_p": round(t.rounds / wall, 3), "tokens": t.new_tokens,
        "drafts": t.drafts, "drafted": t.drafted, "accepted": t.accepted,
        "tokens_per_s": round(t.new_tokens / wall, 3), "ar_rounds": t.ar_rounds,
        "fallback_rounds": t.fallback_rounds,
        "load_rounds": t.load_rounds, "spec_max_sessions": server.config.spec_max_sessions,
        "spec_held": server.load_hold is not None and server.load_hold.held(),  # plain rounds by load now
        **(server.depth_tuner.snapshot() if server.depth_tuner is not None else {}),
        "proposal_wait_s": round(t.draft_s, 6),
        "acceptance_rate": round(t.acceptance_rate, 4),
        "mean_accepted_length": round(t.mean_accepted_length, 4),
        # a SpecPipe session's counted as its driver ends (cancelled or failed too: pipeline.serve)
        "prediction_accepted": t.prediction_accepted + (piped.predicted_accepted if piped else 0),
        "prediction_rejected": t.prediction_rejected + (piped.predicted_rejected if piped else 0),
        "kv_used_mb": round(server.pool.used_bytes / 2**20, 2),
        "draft_connected": bool(server.draft and server.draft.connected.is_set()),
        "draft_reconnects": server.draft.reconnects if server.draft else 0,
        "draft_address": f"{server.draft.host}:{server.draft.port}" if server.draft else None,
        "max_sessions": server.config.max_sessions, "throttled": server.throttled,
        "rejected_requests": server.rejected_requests,
        **prefix_cache_stats(server.model.decoder),
        **server.prefills.snapshot(),
    }
    if server.prefill_gate is not None:
        stats["shared_prefills"] = server.prefill_gate.waits
    if server.pipeline is not None:
        stats.update({"pipeline_connected": server.pipeline.connected.is_set(),
                      "pipeline_rebuilds": server.pipeline.reconnects, "pipeline_error": server.pipeline.last_error,
                      "pipeline_most_in_flight": server.pipeline.most_in_flight,
                      "stages": server.pipeline.refresh_stats()})
    if server.specpipe is not None:
        stats.update(server.specpipe.snapshot())
    if server.fusion is not None:
        stats["drafters"] = server.fusion.snapshot()
        stats["draft_connected"] = any(d["connected"] for d in stats["drafters"].values())
    stats.update(server.compute.stats.snapshot(server.compute.queue_depth))
    return stats
