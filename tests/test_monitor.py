"""The monitor: pure state transitions and render functions (80x24), and the real command
driven in tmux against a live cluster while load runs."""

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from rich.console import Console

from specctl.monitor.render import dashboard, sparkline
from specctl.monitor.view import MonitorState, advance, recent_rates, star_regime
from tests.conftest import poll_until

DRAFT = {"role": "draft", "address": "10.0.0.1:9000", "up": True, "stats": {
    "model": "qwen2.5-coder-0.5b", "targets": 3, "load": 0.87, "queue_depth": 2, "sessions": 3, "R_q": 41.5,
    "t_s_ms": 20.0, "T_wait_ms": 3.2, "T_idle_ms": 1.5, "mean_batch": 1.4, "acceptance_rate": 0.61,
    "mean_accepted_length": 3.4}}


def target(i, up=True, tokens=100):
    return {"role": "target", "address": f"10.0.0.{i + 2}:9100", "up": up, "error": "" if up else "refused",
            "stats": {"sessions": 1, "R_p": 3.5, "tokens_per_s": 11.9, "acceptance_rate": 0.6, "tokens": tokens,
                      "mean_accepted_length": 3.4, "draft_connected": True, "t_s_ms": 50.0} if up else {}}


def feed(tokens=(100, 100, 100), up=(True, True, True)):
    return {"model": "qwen2.5-coder-1.5b", "drafters": [DRAFT],
            "targets": [target(i, u, t) for i, (t, u) in enumerate(zip(tokens, up))]}


def text_of(renderable, width=80):
    console = Console(width=width, record=True, color_system=None, file=open("/dev/null", "w"))
    console.print(renderable)
    return console.export_text()


def test_sparkline_scales_to_the_maximum():
    assert sparkline([]) == ""
    assert sparkline([0, 5, 10]) == "▁▅█"
    assert len(sparkline(list(range(100)), width=60)) == 60


def test_advance_computes_tokens_per_second_and_keeps_data_when_a_poll_fails():
    s0 = advance(MonitorState("gw"), feed((100, 100, 100)), now=10.0)
    s1 = advance(s0, feed((120, 130, 150)), now=12.0)
    assert s1.rate_history == (50.0,)
    down = advance(s1, None, now=13.0, error="ConnectionRefusedError")
    assert down.error == "ConnectionRefusedError" and down.feed == s1.feed and down.rate_history == (50.0,)
    back = advance(down, feed((200, 200, 200)), now=14.0)
    assert back.error == "" and back.rate_history == (50.0,)  # no rate across a gap of unknown length


def test_star_regime_from_measured_times():
    regime = star_regime(DRAFT["stats"], [target(0)["stats"]] * 3)
    assert (regime.targets, regime.n_full, regime.label) == (3, 4, "under-loaded")  # ceil(50/20) + 1 = 4
    assert star_regime({**DRAFT["stats"], "targets": 4}, [target(0)["stats"]]).label == "fully loaded"
    assert star_regime({"targets": 0}, []).label == "idle"


def test_dashboard_fits_80x24_and_shows_down_roles():
    state = advance(advance(MonitorState("http://gw:8000"), feed(), 1.0), feed((150, 140, 100), (True, True, False)), 2.0)
    screen = text_of(dashboard(state, now=2.5))
    lines = screen.rstrip("\n").split("\n")
    assert len(lines) <= 24 and max(len(line) for line in lines) <= 80
    assert "load 87%" in screen and "under-loaded" in screen and "N 3 vs N_full 4" in screen
    assert "T_idle 1.5ms" in screen and "T_wait 3.2ms" in screen and "queue 2" in screen
    assert screen.count(" up ") == 2 and "down" in screen
    assert "tokens/s   90.0" in screen
    feed_down = feed((150, 140, 100), (True, True, False))
    feed_down["targets"][2]["error"] = "its pipeline is down (stage 10.0.0.5:9101: timed out)"
    screen_down = text_of(dashboard(advance(state, feed_down, 3.0), now=3.5))
    reason = f"{feed_down['targets'][2]['address']} down: its pipeline is down (stage 10.0.0.5:9101: timed out)"
    assert reason in screen_down.split("\n")  # its own line, below the table
    feed_down["targets"][2]["error"] = "x" * 200
    lines = text_of(dashboard(advance(state, feed_down, 3.0), now=3.5)).rstrip("\n").split("\n")
    assert max(len(line) for line in lines) <= 80 and any(line.endswith("x…") for line in lines)
    assert dashboard(state, now=2.5) is not dashboard(state, now=2.5)  # fresh renderables ...
    assert text_of(dashboard(state, now=2.5)) == screen  # ... of the same picture


def test_dashboard_when_the_gateway_is_down():
    screen = text_of(dashboard(advance(MonitorState("http://gw:8000"), None, 1.0, "ClientConnectorError"), now=1.0))
    assert "DOWN: ClientConnectorError" in screen


def test_a_gateway_that_died_shows_no_stale_rows_and_its_whole_error_in_80_columns():
    live = advance(advance(MonitorState("http://gateway.example.internal:8000"), feed(), 1.0), feed((150, 140, 100)), 2.0)
    assert text_of(dashboard(live, now=2.5)).count(" up ") == 3
    error = "ClientConnectorError: Cannot connect to host gateway.example.internal:8000 ssl:default [Connect call failed]"
    dead = advance(live, None, 9.0, error)
    screen = text_of(dashboard(dead, now=9.0))
    lines = screen.rstrip("\n").split("\n")
    assert max(len(line) for line in lines) <= 80
    assert f"DOWN: {error}"[:78] in screen and " up " not in screen and "load" not in screen
    assert "no current data (last answer 7s ago); retrying" in screen


def test_monitor_once_exits_non_zero_when_nothing_answers():
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, not listening: connections are refused
        proc = subprocess.run([sys.executable, "-m", "specctl", "monitor", "--once", "--gateway", f"http://127.0.0.1:{port}"],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "DOWN" in proc.stdout and "Traceback" not in proc.stderr


needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def tmux(*args):
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=30)


@needs_tmux
def test_monitor_in_tmux_shows_changing_numbers_and_a_target_going_down(tiny_dir):
    from specctl.cluster.embedded import ClusterConfig, ClusterThread
    from specctl.config import build_config

    config = build_config(None, target=str(tiny_dir["llama"]), draft=f"{tiny_dir['llama']}@2", mode="chain", depth=3,
                          dtype="fp32", draft_quant="none")
    cluster = ClusterThread(config, ClusterConfig(targets=2, gateway_port=0))
    urls = cluster.start()
    session = f"specctl-monitor-{time.time_ns()}"
    stop = threading.Event()

    def load():
        while not stop.is_set():
            body = json.dumps({"prompt": "load", "max_tokens": 24, "temperature": 0, "ignore_eos": True}).encode()
            request = urllib.request.Request(urls["gateway"] + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(request, timeout=30).read()
            except OSError:
                pass

    try:
        assert tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "24",
                    f"{sys.executable} -m specctl monitor --gateway {urls['gateway']} --interval 0.25").returncode == 0
        pane = lambda: tmux("capture-pane", "-p", "-t", session).stdout  # noqa: E731
        poll_until(pane, lambda idle: "specctl monitor" in idle and idle.count(" up ") == 2, 30)
        workers = [threading.Thread(target=load, daemon=True) for _ in range(2)]
        for worker in workers:
            worker.start()
        frames = []

        def moved(frame: str) -> bool:  # the numbers move while load runs, drafting included
            frames.append(frame)
            return len(set(frames)) > 1 and any("R_q 0.0/s" not in f for f in frames)

        poll_until(pane, moved, 30, interval=0.25)
        assert all(len(line) <= 80 for frame in frames for line in frame.splitlines())
        stop.set()
        for worker in workers:
            worker.join(timeout=30)
        cluster.loop.call_soon_threadsafe(lambda: cluster.loop.create_task(cluster.cluster.targets[1].close()))
        final = poll_until(pane, lambda frame: "down" in frame, 15)
        assert "down" in final and " up " in final, final
        print(final)
    finally:
        stop.set()
        tmux("kill-session", "-t", session)
        cluster.stop()


def test_a_relayed_feed_without_fresher_numbers_leaves_the_history_alone():
    def stamped(tokens, seen_at):
        f = feed(tokens)
        for t in f["targets"]:
            t["seen_at"] = seen_at
        return f

    s1 = advance(advance(MonitorState("gw"), stamped((0, 0, 0), 100.0), now=100.2), stamped((10, 10, 10), 101.0), 101.1)
    assert s1.rate_history == (30.0,)
    s2 = advance(s1, stamped((10, 10, 10), 101.0), now=101.3)  # the gateway has not polled again yet
    assert s2.rate_history == (30.0,) and s2.polled_at == 101.0


def test_recent_rates_difference_the_lifetime_counters():
    before = {"jobs": 100, "passes": 80, "busy_s": 10.0, "wait_s": 1.0, "idle_s": 4.0, "rounds": 50, "tokens": 150}
    after = {"jobs": 120, "passes": 90, "busy_s": 11.5, "wait_s": 1.2, "idle_s": 4.1, "rounds": 60, "tokens": 190}
    assert recent_rates(before, after, 2.0) == {"load": 0.75, "t_s_ms": 75.0, "T_wait_ms": 10.0, "T_idle_ms": 10.0,
                                                "mean_batch": 2.0, "R_q": 10.0, "R_p": 5.0, "tokens_per_s": 20.0}
    assert recent_rates(after, before, 2.0) == {}  # a restart: counters went backwards


def test_the_screen_shows_recent_rates_once_two_fresh_snapshots_exist():
    def stamped(busy, seen_at):
        f = feed()
        f["drafters"] = [{**DRAFT, "seen_at": seen_at, "stats": {**DRAFT["stats"], "busy_s": busy, "jobs": 10 * busy,
                                                                  "passes": 10 * busy, "wait_s": 0, "idle_s": 0}}]
        return f

    s1 = advance(MonitorState("gw"), stamped(1.0, 10.0), 10.0)
    s2 = advance(s1, stamped(1.5, 11.0), 11.0)
    assert "load 50%" in text_of(dashboard(s2, now=11.0))  # lifetime load said 87%
    s3 = advance(s2, stamped(1.5, 11.0), 11.5)  # relayed again, nothing fresher
    assert s3.recent == s2.recent


def test_a_pre_speculating_draft_shows_its_cache_in_80x24():
    prespec = {"hit_rate": 0.62, "ready_rate": 0.41, "branches_used": 31, "branches_drafted": 400, "leftover_used": 0.45,
               "fallback_jit": 12, "jit_carried": 5, "fallback_ngram": 7, "hits": 40, "partial_hits": 22, "short_answers": 15,
               "early_answers": 9, "skipped": 3}
    drafter = {**DRAFT, "stats": {**DRAFT["stats"], "prespec": prespec}}
    state = advance(MonitorState("http://gw:8000"), {**feed(), "drafters": [drafter]}, 1.0)
    screen = text_of(dashboard(state, now=1.5))
    lines = screen.rstrip("\n").split("\n")
    assert len(lines) <= 24 and max(len(line) for line in lines) <= 80
    assert "prespec hit 62%" in screen and "41% ready" in screen
    assert "branches 31/400" in screen and "leftover 45%" in screen
    assert "miss jit 12 ng 7" in screen and "carry 5" in screen
    assert "hits 40 partial 22" in screen and "short 15" in screen and "early 9" in screen and "skip 3" in screen
    assert "prespec" not in text_of(dashboard(advance(MonitorState("x"), feed(), 1.0), now=1.5))


def test_a_pre_speculating_draft_keeps_each_cell_on_one_line_beside_a_prefix_cache():
    # Seen live (2026-12-07): with the prefix cache row and a long T_wait, "(40% ready)" wrapped
    # onto a line of its own.
    prespec = {"hit_rate": 0.43, "ready_rate": 0.40, "branches_used": 29, "branches_drafted": 244,
               "leftover_used": 0.14, "fallback_jit": 28, "jit_carried": 1, "fallback_ngram": 10, "hits": 29, "partial_hits": 10,
               "short_answers": 5, "early_answers": 17, "skipped": 35}
    stats = {**DRAFT["stats"], "T_wait_ms": 1436.6, "T_idle_ms": 703.0, "prefix_cache_query_tokens": 900,
             "prefix_cache_hit_rate": 0.44, "prefix_cache_entries": 16, "prefix_cache_mb": 18.0, "shared_prefills": 0,
             "prespec": prespec}
    state = advance(MonitorState("http://gw:8000"), {**feed(), "drafters": [{**DRAFT, "stats": stats}]}, 1.0)
    screen = text_of(dashboard(state, now=1.5))
    for cell in ("prespec hit 43%", "40% ready", "branches 29/244", "leftover 14%", "miss jit 28 ng 10",
                 "hits 29 partial 10", "short 5", "early 17", "skip 35 carry 1"):
        assert cell in screen, cell


def test_a_target_with_several_drafters_shows_a_row_per_drafter_in_80x24():
    drafters = {"10.0.0.1:9000": {"chosen_rounds": 120, "accepted_tokens": 310, "failures": 2, "mean_score": 0.64,
                                  "connected": True},
                "ngram": {"chosen_rounds": 45, "accepted_tokens": 90, "failures": 0, "mean_score": None,
                          "connected": True},
                "10.0.0.2:9000": {"chosen_rounds": 7, "accepted_tokens": 3, "failures": 9, "mean_score": 0.1,
                                  "connected": False},
                "10.0.0.3:9000": {"chosen_rounds": 0, "accepted_tokens": 0, "failures": 3, "mean_score": None,
                                  "connected": True, "benched": True},
                "none": {"chosen_rounds": 33, "accepted_tokens": 0, "failures": 0, "mean_score": None, "connected": True}}
    data = feed(tokens=(100,), up=(True,))
    data["targets"][0]["stats"]["drafters"] = drafters
    screen = text_of(dashboard(advance(MonitorState("http://gw:8000"), data, 1.0), now=1.5))
    lines = screen.rstrip("\n").split("\n")
    assert len(lines) <= 24 and max(len(line) for line in lines) <= 80
    assert "└ 10.0.0.1:9000" in screen and "120r" in screen and "acc 310" in screen and "m 0.64" in screen
    assert "└ ngram" in screen and "fail 9" in screen and "down" in screen
    assert "└ none" in screen and "plain" in screen and "33r" in screen  # the rounds decoded plainly
    benched = next(line for line in lines if "└ 10.0.0.3:9000" in line)
    assert "late" in benched and "fail 3" in benched  # past the deadline round after round: sitting out


def test_a_target_loaded_past_its_spec_max_sessions_shows_its_plain_rounds_in_the_draft_column():
    data = feed(tokens=(100,), up=(True,))
    data["targets"][0]["stats"].update(draft_connected=True, spec_held=True, spec_max_sessions=3)
    screen = text_of(dashboard(advance(MonitorState("http://gw:8000"), data, 1.0), now=1.5))
    lines = screen.rstrip("\n").split("\n")
    assert len(lines) <= 24 and max(len(line) for line in lines) <= 80
    assert "off>3" in screen
    data["targets"][0]["stats"]["spec_held"] = False
    assert "off>3" not in text_of(dashboard(advance(MonitorState("http://gw:8000"), data, 1.0), now=1.5))


@pytest.mark.parametrize("now, shown", [("plain", "auto:off"), ("4", "auto:4"), ("own", "auto:own")])
def test_a_target_learning_its_depth_by_load_shows_the_depth_it_runs_now(now, shown):
    data = feed(tokens=(100,), up=(True,))
    data["targets"][0]["stats"].update(draft_connected=True, spec_depth_now=now, spec_depth_load=4)
    screen = text_of(dashboard(advance(MonitorState("http://gw:8000"), data, 1.0), now=1.5))
    assert max(len(line) for line in screen.rstrip("\n").split("\n")) <= 80
    assert shown in screen
    data["targets"][0]["stats"]["draft_connected"] = False  # no draft: every round is plain, whatever was learnt
    assert "auto:" not in text_of(dashboard(advance(MonitorState("http://gw:8000"), data, 1.0), now=1.5))


def test_prefix_caches_show_their_hit_rate_in_80x24_once_asked():
    cache = {"prefix_cache_hit_rate": 0.734, "prefix_cache_hit_tokens": 734, "prefix_cache_query_tokens": 1000,
             "prefix_cache_entries": 12, "prefix_cache_mb": 37.4, "shared_prefills": 4}
    data = feed(tokens=(100,), up=(True,))
    data["targets"][0]["stats"].update(cache)
    data["drafters"] = [{**DRAFT, "stats": {**DRAFT["stats"], **cache, "prefix_cache_hit_rate": 0.5}}]
    screen = text_of(dashboard(advance(MonitorState("http://gw:8000"), data, 1.0), now=1.5))
    lines = screen.rstrip("\n").split("\n")
    assert len(lines) <= 24 and max(len(line) for line in lines) <= 80
    assert "prefix cache" in screen and "hit 73%" in screen and "12 txt" in screen and "37 MiB" in screen
    assert "prefix cache hit 50%" in screen and "12 texts" in screen
    assert screen.count("shared 4") == 2  # prefills shared (engine.prefill_gate), target and draft
    idle = feed(tokens=(100,), up=(True,))  # a cache nobody asked yet: no row
    idle["targets"][0]["stats"].update({**cache, "prefix_cache_query_tokens": 0})
    assert "prefix cache" not in text_of(dashboard(advance(MonitorState("x"), idle, 1.0), now=1.5))


def test_tokens_drafted_from_predictions_show_under_their_target_in_80x24():
    data = feed(tokens=(100,), up=(True,))
    assert "predicted" not in text_of(dashboard(advance(MonitorState("x"), data, 1.0), now=1.5))  # none yet
    data["targets"][0]["stats"].update({"prediction_accepted": 1230, "prediction_rejected": 410})
    screen = text_of(dashboard(advance(MonitorState("http://gw:8000"), data, 1.0), now=1.5))
    lines = screen.rstrip("\n").split("\n")
    assert len(lines) <= 24 and max(len(line) for line in lines) <= 80
    row = next(line for line in lines if "predicted" in line)
    assert row.split()[1:] == ["75%", "acc", "1230", "rej", "410"]


def test_the_gateway_line_shows_latency_percentiles_in_80x24():
    from specctl.gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    assert metrics.latency_summary() == {"generations": 0, **{f"{n}_ms_p{p}": None for n in ("ttft", "tpot", "e2e")
                                                              for p in (50, 90)}}
    for i in range(10):  # first token after (i + 1) * 10 ms, then 4 more tokens 20 ms apart
        metrics.record_latency(0.0, (i + 1) / 100, (i + 1) / 100 + 0.08, 5)
    metrics.record_latency(0.0, None, 2.5, 0)  # a generation that gave no token: end to end only
    summary = metrics.latency_summary()
    assert summary["generations"] == 11
    assert (summary["ttft_ms_p50"], summary["ttft_ms_p90"]) == pytest.approx((50.0, 90.0))  # nearest rank
    assert (summary["tpot_ms_p50"], summary["tpot_ms_p90"]) == pytest.approx((20.0, 20.0))
    assert (summary["e2e_ms_p50"], summary["e2e_ms_p90"]) == pytest.approx((140.0, 180.0))
    data = {**feed(), "gateway": {"requests_running": 3, **summary}}
    screen = text_of(dashboard(advance(MonitorState("http://gw:8000"), data, 1.0), now=1.5))
    lines = screen.rstrip("\n").split("\n")
    assert len(lines) <= 24 and max(len(line) for line in lines) <= 80
    assert "gateway 3 running  TTFT 50/90ms  TPOT 20/20ms  e2e 140/180ms  (p50/p90)" in screen
    for _ in range(100):
        metrics.record_latency(0.0, 1.5, 12.0, 2)
    assert metrics.latency_summary()["generations"] == 100  # the last 100 only
    data["gateway"] = {"requests_running": 12, **metrics.latency_summary()}
    screen = text_of(dashboard(advance(MonitorState("http://gw:8000"), data, 1.0), now=1.5))
    assert "gateway 12 running  TTFT 1.5/1.5s  TPOT 10/10s  e2e 12/12s  (p50/p90)" in screen
    idle = text_of(dashboard(advance(MonitorState("x"), {**feed(), "gateway": {"requests_running": 0,
                                                                             "generations": 0}}, 1.0), now=1.5))
    assert "gateway 0 running\n" in idle and "TTFT" not in idle
    data["gateway"].update(requests_running=4, requests_waiting=2)  # generations queued for a free session
    screen = text_of(dashboard(advance(MonitorState("http://gw:8000"), data, 1.0), now=1.5))
    assert "gateway 4 running, 2 waiting  TTFT 1.5/1.5s  TPOT 10/10s  e2e 12/12s  (p50/p90)" in screen
    data["gateway"].update(resumed_generations=3)  # taken over from a lost target instance
    screen = text_of(dashboard(advance(MonitorState("http://gw:8000"), data, 1.0), now=1.5))
    assert "gateway 4 running, 2 waiting, 3 resumed  TTFT 1.5/1.5s  TPOT 10/10s  e2e 12/12s\n" in screen
    data["gateway"].pop("resumed_generations")
    data["gateway"].update(ttft_ms_p50=123.0, ttft_ms_p90=456.0, tpot_ms_p50=11.0, tpot_ms_p90=999.0,
                           requests_waiting=1024)
    screen = text_of(dashboard(advance(MonitorState("http://gw:8000"), data, 1.0), now=1.5))
    assert max(len(line) for line in screen.split("\n")) <= 80  # the legend left out
    assert "gateway 4 running, 1024 waiting  TTFT 123/456ms  TPOT 11/999ms  e2e 12/12s\n" in screen


def test_a_poll_that_cannot_connect_says_why_in_a_few_words():
    import aiohttp
    from aiohttp.client_reqrep import ConnectionKey

    from specctl.monitor.view import poll_error

    key = ConnectionKey("127.0.0.1", 1, False, True, None, None, None)
    refused = aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 1)"))
    assert poll_error("http://127.0.0.1:1", refused) == "cannot reach http://127.0.0.1:1 (connection refused)"
    assert poll_error("http://gw:8000", ValueError("bad feed")) == "ValueError: bad feed"
    assert poll_error("http://gw:8000", TimeoutError()) == "TimeoutError"
    screen = text_of(dashboard(advance(MonitorState("http://127.0.0.1:1"), None, 1.0,
                                       poll_error("http://127.0.0.1:1", refused)), now=1.0))
    assert "DOWN: cannot reach http://127.0.0.1:1 (connection refused)" in screen


def test_a_target_reading_long_prompts_shows_how_many_and_the_tokens_left_on_one_line():
    data = feed(tokens=(100,), up=(True,))
    data["targets"][0]["stats"].update(prefill_sessions=2, prefill_tokens_left=24733, prefix_cache_query_tokens=900,
                                       prefix_cache_hit_rate=0.44, prefix_cache_entries=16, prefix_cache_mb=18.0)
    screen = text_of(dashboard(advance(MonitorState("http://gw:8000"), data, 1.0), now=1.5))
    lines = screen.rstrip("\n").split("\n")
    row = next(line for line in lines if "reading prompts" in line)
    assert row.split() == ["reading", "prompts", "2", "24,733", "tok", "left"]
    assert max(len(line) for line in lines) <= 80
    data["targets"][0]["stats"]["prefill_sessions"] = 0  # none: no row
    assert "reading prompts" not in text_of(dashboard(advance(MonitorState("http://gw:8000"), data, 1.0), now=1.5))
