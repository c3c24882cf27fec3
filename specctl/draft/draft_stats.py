"""What a draft server reports (the STATS reply: the gateway's /metrics and stats feed, the
monitor): its connections, compute thread (StarSD's t_s, T_wait, T_idle), sessions, SpecPipe
levels, prefix cache and pre-speculation."""

from __future__ import annotations

import time

from specctl.engine.prefix_cache import prefix_cache_stats


def draft_snapshot(server) -> dict:
    """``server``: a draft.server.DraftServer."""
    stats = {"model": server.model.name, "connections": len(server.connections),
             "targets": sum(c.role == "target" for c in server.connections.values()),
             "uptime_s": round(time.time() - server.started, 1), "throttled": server.throttled,
             "rejected_requests": server.rejected_requests, **prefix_cache_stats(server.model.decoder)}
    stats.update(server.compute.stats.snapshot(server.compute.queue_depth))
    stats.update(server.table.snapshot())
    stats.update(server.levels.snapshot())
    if server.prefill_gate is not None:
        stats["shared_prefills"] = server.prefill_gate.waits
    stats["R_q"] = stats.pop("jobs_per_s")
    sent = server.proposals_sent
    stats["proposal_bytes_mean"] = round(server.proposal_bytes / sent, 1) if sent else 0.0
    if "prespec" in stats:  # the share of the draft's idle time pre-speculation put to use
        stats["prespec"]["leftover_used"] = round(stats["background_s"] / stats["idle_s"], 4) if stats["idle_s"] else 0.0
    return stats
