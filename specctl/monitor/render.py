"""The monitor's screen as pure functions of a MonitorState: same state, same picture.
Laid out for an 80x24 terminal: a header, one panel per draft server, one row per target
instance, and a tokens/s sparkline."""

from __future__ import annotations

import time

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from specctl.monitor.view import MonitorState, shown, star_regime
from specctl.spec.routing import NONE

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: tuple[float, ...] | list[float], width: int = 60) -> str:
    values = list(values)[-width:]
    if not values:
        return ""
    top = max(values) or 1.0
    return "".join(BARS[min(len(BARS) - 1, int(v / top * (len(BARS) - 1) + 0.5))] for v in values)


def _ms(value) -> str:
    return f"{value:.1f}ms" if isinstance(value, (int, float)) else "-"


def header(state: MonitorState, now: float) -> Text:
    text = Text(f"specctl monitor  {state.source}"[:78], style="bold")
    if state.feed and state.feed.get("model"):
        text.append(f"  model {state.feed['model']}"[: max(0, 78 - len(text))], style="cyan")
    if state.error:  # on its own line, so an 80-column terminal shows it whole
        text.append("\n" + f"DOWN: {state.error}"[:78], style="bold red")
    elif state.polled_at:
        text.append(f"  data {max(0.0, now - state.polled_at):.1f}s old", style="dim")
    return text


def draft_panel(draft: dict, targets: list[dict], state: MonitorState) -> Panel:
    address = draft.get("address", "?")
    if not draft.get("up"):
        # two lines at most: what went wrong and what to do (a TLS or auth hint) fit in them
        return Panel(Text(f"down: {draft.get('error') or 'no answer'}"[:148], style="red"),
                     title=f"draft {address}", border_style="red")
    s = shown(draft, state)
    regime = star_regime(s, [shown(t, state) for t in targets if t.get("up")])
    table = Table.grid(padding=(0, 2))
    for _ in range(4):
        table.add_column()
    load = float(s.get("load", 0.0))
    table.add_row(f"load [bold]{load:.0%}[/]", f"queue {s.get('queue_depth', 0)}", f"sessions {s.get('sessions', 0)}",
                  f"R_q {s.get('R_q', 0):.1f}/s")
    table.add_row(f"t_s {_ms(s.get('t_s_ms'))}", f"T_wait {_ms(s.get('T_wait_ms'))}", f"T_idle {_ms(s.get('T_idle_ms'))}",
                  f"batch {s.get('mean_batch', 0):.1f}")
    n_full = "?" if regime.n_full is None else str(regime.n_full)
    style = "green" if regime.label == "fully loaded" else "yellow"
    table.add_row(f"[{style}]{regime.label}[/]", f"N {regime.targets} vs N_full {n_full}",
                  f"accept {s.get('acceptance_rate', 0):.0%}", f"MAL {s.get('mean_accepted_length', 0):.2f}")
    if s.get("prefix_cache_query_tokens"):
        table.add_row(f"prefix cache hit {s.get('prefix_cache_hit_rate', 0):.0%}",
                      f"{s.get('prefix_cache_entries', 0)} texts", f"{s.get('prefix_cache_mb', 0):.0f} MiB",
                      f"shared {s.get('shared_prefills', 0)}")
    if isinstance(s.get("prespec"), dict):
        for row in prespec_rows(s["prespec"]):
            table.add_row(*row)
    return Panel(table, title=f"draft {address} ({s.get('model', '?')})"[:60], border_style="blue")


def prespec_rows(prespec: dict) -> list[tuple[str, str, str, str]]:
    """Pre-speculation on the draft server: cache hits and the share of outcomes whose next
    proposal was drafted ahead, branches used of drafted, idle time put to use; then how hits
    were answered (still being drafted, with the tokens drafted so far, from the event loop),
    how misses were drafted, the rounds not pre-speculated and the misses drafted in forwards
    that carried the other plans. Short cells: beside the prefix cache's row and a long T_wait
    four columns have about 18 characters each in 80."""
    return [(f"prespec hit [bold]{prespec.get('hit_rate', 0):.0%}[/]", f"{prespec.get('ready_rate', 0):.0%} ready",
             f"branches {prespec.get('branches_used', 0)}/{prespec.get('branches_drafted', 0)}",
             f"leftover {prespec.get('leftover_used', 0):.0%}"),
            (f"hits {prespec.get('hits', 0)} partial {prespec.get('partial_hits', 0)}",
             f"short {prespec.get('short_answers', 0)} early {prespec.get('early_answers', 0)}",
             f"miss jit {prespec.get('fallback_jit', 0)} ng {prespec.get('fallback_ngram', 0)}",
             f"skip {prespec.get('skipped', 0)} carry {prespec.get('jit_carried', 0)}")]


def gateway_line(gateway: dict) -> Text:
    """The gateway's requests in flight, the generations waiting for a free session, those
    another target instance went on with after theirs was lost, and its latencies, p50/p90
    over its last generations (gateway.metrics.RECENT_GENERATIONS): time to first token, time
    per output token, end to end. The legend goes first when 80 columns cannot hold it all."""
    head = f"{gateway.get('requests_running', 0)} running"
    if gateway.get("requests_waiting"):
        head += f", {gateway['requests_waiting']} waiting"
    if gateway.get("resumed_generations"):
        head += f", {gateway['resumed_generations']} resumed"
    text = Text("gateway ", style="bold").append(head, style="bold yellow" if gateway.get("requests_waiting") else "")
    if gateway.get("generations"):
        pairs = "  ".join(f"{label} {_pair(gateway.get(f'{name}_ms_p50'), gateway.get(f'{name}_ms_p90'))}"
                          for label, name in (("TTFT", "ttft"), ("TPOT", "tpot"), ("e2e", "e2e")))
        tail = f"  {pairs}  (p50/p90)"
        text.append(tail if len(text) + len(tail) <= 79 else f"  {pairs}", style="cyan")
    return text


def _pair(p50: float | None, p90: float | None) -> str:
    """Two latencies in ms with one unit: 50/90ms, or 0.8/2.5s once the larger is a second (whole
    seconds from 10 s), so the line keeps to 80 columns."""
    if p50 is None or p90 is None:
        return "-"
    if p90 < 1000:
        return f"{p50:.0f}/{p90:.0f}ms"
    digits = 1 if p90 < 10_000 else 0
    return f"{p50 / 1000:.{digits}f}/{p90 / 1000:.{digits}f}s"


def targets_table(targets: list[dict], state: MonitorState) -> Table:
    table = Table(expand=True, box=None, header_style="bold", pad_edge=False)
    for name, justify in (("target", "left"), ("state", "left"), ("sess", "right"), ("R_p", "right"),
                          ("tok/s", "right"), ("accept", "right"), ("MAL", "right"), ("draft", "left")):
        table.add_column(name, justify=justify, no_wrap=True)
    for t in targets:
        s = shown(t, state)
        if not t.get("up"):
            table.add_row(t.get("address", "?"), Text("down", style="bold red"), "-", "-", "-", "-", "-", "-")
            continue
        draft = "ok" if s.get("draft_connected") else Text("AR", style="yellow")
        if s.get("spec_held") and s.get("draft_connected"):  # loaded past spec_max_sessions: plain rounds
            draft = Text(f"off>{s.get('spec_max_sessions')}", style="yellow")
        elif "spec_depth_now" in s and s.get("draft_connected"):  # the depth its load pays for, learnt
            now = s["spec_depth_now"]
            draft = Text("auto:off", style="yellow") if now == "plain" else f"auto:{now}"
        table.add_row(t.get("address", "?"), Text("up", style="green"), str(s.get("sessions", 0)),
                      f"{s.get('R_p', 0):.1f}", f"{s.get('tokens_per_s', 0):.1f}", f"{s.get('acceptance_rate', 0):.0%}",
                      f"{s.get('mean_accepted_length', 0):.2f}", draft)
        if "specpipe_steps" in s:
            table.add_row(Text(f"  SpecPipe w={s.get('specpipe_width')}", style="dim"), "", "", "", "",
                          f"hit {s.get('specpipe_hit_rate', 0):.0%}", f"fl {s.get('specpipe_flushes', 0)}",
                          f"rf +{s.get('specpipe_refill_tokens', 0)}")
        if "pipeline_connected" in s and not s["pipeline_connected"]:
            table.add_row(Text("  pipeline down", style="bold red"), "", "", "", "", "", "", "")
        if s.get("prefill_sessions"):
            table.add_row(*prefill_row(s))
        if s.get("prefix_cache_query_tokens"):
            table.add_row(*prefix_cache_row(s))
        if s.get("prediction_accepted") or s.get("prediction_rejected"):
            table.add_row(*prediction_row(s))
        for stage in s.get("stages", []):
            table.add_row(*stage_row(stage))
        for name, drafter in (s.get("drafters") or {}).items():
            table.add_row(*drafter_row(name, drafter))
    return table


def down_reasons(targets: list[dict]) -> list[Text]:
    """Why each target instance that is down is (below the table: a reason is too long for a
    cell), cut to the 80 columns."""
    lines = (f"{t.get('address', '?')} down: {t['error']}" for t in targets if not t.get("up") and t.get("error"))
    return [Text(line if len(line) <= 79 else line[:78] + "…", style="red") for line in lines]


def drafter_row(name: str, drafter: dict) -> tuple:
    """One drafter of a target with several: rounds routed to it, tokens accepted, its score
    ("none": the rounds its sessions decoded plainly, where that measured faster)."""
    score = drafter.get("mean_score")
    if name == NONE:
        state = Text("plain", style="dim")
    elif drafter.get("benched") and drafter.get("connected", True):  # late round after round: sitting out
        state = Text("late", style="yellow")
    else:
        state = Text("ok", style="green") if drafter.get("connected", True) else Text("down", style="bold red")
    return (Text(f"  └ {name}"[:28], style="dim"), state, "", f"{drafter.get('chosen_rounds', 0)}r", "",
            f"acc {drafter.get('accepted_tokens', 0)}", "-" if score is None else f"m {score:.2f}",
            f"fail {drafter.get('failures', 0)}")


def prefill_row(s: dict) -> tuple:
    """A target's sessions still reading their prompt and the tokens they have left (a long
    prompt holds the compute thread for seconds to minutes on a CPU)."""
    return (Text("  reading prompts", style="dim"), "", str(s.get("prefill_sessions", 0)), "", "", "",
            f"{s.get('prefill_tokens_left', 0):,}", "tok left")


def prefix_cache_row(s: dict) -> tuple:
    """A target's prefix cache: prefills shared (engine.prefill_gate), the share of prompt tokens
    it served, its entries and memory."""
    return (Text("  prefix cache", style="dim"), "", "", "", f"shared {s.get('shared_prefills', 0)}",
            f"hit {s.get('prefix_cache_hit_rate', 0):.0%}",
            f"{s.get('prefix_cache_entries', 0)} txt", f"{s.get('prefix_cache_mb', 0):.0f} MiB")


def prediction_row(s: dict) -> tuple:
    """A target's tokens drafted from requests' predictions (Predicted Outputs): the share
    verification accepted, and how many it accepted and rejected."""
    accepted, rejected = s.get("prediction_accepted", 0), s.get("prediction_rejected", 0)
    return (Text("  predicted", style="dim"), "", "", "", "", f"{accepted / max(accepted + rejected, 1):.0%}",
            f"acc {accepted}", f"rej {rejected}")


def stage_row(stage: dict) -> tuple:
    """One pipeline stage under its target: layers, step time, pruned KV, dead forwards dropped,
    dead rows of live forwards skipped, sessions."""
    return (Text(f"  └ stage {stage.get('stage', '?')} {stage.get('layers', '')}", style="dim"), "",
            str(stage.get("sessions", 0)), "", _ms(stage.get("step_ms")), f"pr {stage.get('pruned_positions', 0)}",
            f"dr {stage.get('dropped_forwards', 0)}", f"sk {stage.get('skipped_rows', 0)}")


def dashboard(state: MonitorState, now: float | None = None) -> RenderableType:
    now = time.time() if now is None else now
    parts: list[RenderableType] = [header(state, now)]
    if state.error:
        # The last numbers are not shown as if they were current: the source is not answering.
        last = f" (last answer {now - state.polled_at:.0f}s ago)" if state.polled_at else ""
        parts.append(Text(f"no current data{last}; retrying", style="dim"))
        return Group(*parts)
    feed = state.feed or {}
    targets = feed.get("targets", [])
    if isinstance(feed.get("gateway"), dict):
        parts.append(gateway_line(feed["gateway"]))
    for draft in feed.get("drafters", [])[:2]:
        parts.append(draft_panel(draft, targets, state))
    if targets:
        parts.append(targets_table(targets[:8], state))
        parts += down_reasons(targets[:8])
        if len(targets) > 8:
            parts.append(Text(f"… and {len(targets) - 8} more target instances", style="dim"))
    elif not state.error:
        parts.append(Text("waiting for the first stats…", style="dim"))
    rate = state.rate_history[-1] if state.rate_history else 0.0
    parts.append(Text(f"tokens/s {rate:6.1f} ", style="bold").append(sparkline(state.rate_history), style="magenta"))
    return Group(*parts)
