"""`specctl up --stages 3`: the gateway in front of a target split over 3 stages answers
exactly what the whole target generates; with a stage gone it answers 503 with the reason."""

import asyncio
import json
import re
import urllib.request

import pytest

from specctl.cluster.embedded import ClusterConfig, ClusterThread
from specctl.config import build_config
from specctl.monitor.render import dashboard
from specctl.monitor.view import MonitorState, advance
from tests.conftest import poll_until
from tests.test_gateway import PROMPT, post, specctl_generate
from tests.test_monitor import text_of


@pytest.fixture
def staged_cluster(tiny_dir):
    config = build_config(None, target=str(tiny_dir["llama"]), draft=f"{tiny_dir['llama']}@2", mode="tree", depth=3,
                          dtype="fp32", draft_quant="none", max_sessions=8)
    thread = ClusterThread(config, ClusterConfig(targets=1, gateway_port=0, stages=3))
    urls = thread.start()
    yield thread, urls
    thread.stop()


def test_gateway_over_a_three_stage_target_is_exact_and_a_dead_stage_gives_503(staged_cluster, tiny_dir):
    thread, urls = staged_cluster
    assert len(urls["stages"]) == 1 and len(urls["stages"][0]) == 2  # stages 2 and 3 of the one instance
    reference = specctl_generate(tiny_dir, PROMPT, 20)
    body = {"model": str(tiny_dir["llama"]), "prompt": PROMPT, "max_tokens": 20, "temperature": 0}
    status, _, raw = post(urls["gateway"] + "/v1/completions", body)
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == reference["text"]

    # Per-stage numbers reach the stats feed, /metrics and the monitor's table.
    def stage_feed():
        with urllib.request.urlopen(urls["gateway"] + "/v1/stats", timeout=10) as response:
            return json.loads(response.read())
    def counted(f):  # the feed's stage numbers are from the poll before last: wait for ones after the request
        # (both counts: a poll taken between the request's first forwards and its first pruned
        # tree shows forwards without pruned positions — a likely cause of the one failure seen)
        stages = f["targets"][0].get("stats", {}).get("stages", [])
        return len(stages) == 2 and all(s["forwards"] > 0 and s["pruned_positions"] > 0 for s in stages)
    feed = poll_until(stage_feed, counted)
    stages = feed["targets"][0]["stats"]["stages"]
    assert [(s["stage"], s["layers"]) for s in stages] == [("2/3", "2:3"), ("3/3", "3:4")]
    assert all(s["forwards"] > 0 and s["pruned_positions"] > 0 for s in stages), stages
    with urllib.request.urlopen(urls["gateway"] + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert re.search(r'specctl:stage_step_ms\{address="[^"]+",stage="3/3"\} \d', metrics)
    assert re.search(r'specctl:stage_dropped_forwards\{address="[^"]+",stage="2/3"\} 0', metrics)  # tree rounds: none
    assert re.search(r'specctl:stage_skipped_rows\{address="[^"]+",stage="2/3"\} 0', metrics)
    screen = text_of(dashboard(advance(MonitorState("gw"), feed, now=1.0), now=1.0))
    assert "└ stage 2/3 2:3" in screen and "└ stage 3/3 3:4" in screen and "dr 0" in screen and "sk 0" in screen

    pipeline = thread.cluster.pipelines[0]
    asyncio.run_coroutine_threadsafe(pipeline.servers[-1].close(), thread.loop).result(30)
    status, headers, raw = post(urls["gateway"] + "/v1/completions", body)
    assert status == 503, raw
    assert "pipeline" in json.loads(raw)["error"]["message"]


def test_several_drafters_in_front_of_a_two_stage_target_are_exact(tiny_dir):
    """`specctl up --drafters A,ngram,suffix --stages 2`: fused proposals verified through the
    stages. The model drafter stops where the profile says (draft_stop, as a lone draft does), and
    a late drafter is waited for: every role shares the one compute thread (skipped at 0.5 s, a
    CPU 0.5B never drafted and `up` ran at half the target alone's speed)."""
    from specctl.cluster.embedded import EMBEDDED_DRAFT_DEADLINE_S

    config = build_config(None, target=str(tiny_dir["llama"]), mode="multi", draft_stop=0.2,
                          drafters=f"{tiny_dir['llama']}@2,ngram,suffix", depth=3, dtype="fp32", draft_quant="none")
    thread = ClusterThread(config, ClusterConfig(targets=1, gateway_port=0, stages=2))
    urls = thread.start()
    try:
        prompt = "one two three one two three one two"
        reference = specctl_generate(tiny_dir, prompt, 24)
        body = {"model": str(tiny_dir["llama"]), "prompt": prompt, "max_tokens": 24, "temperature": 0}
        status, _, raw = post(urls["gateway"] + "/v1/completions", body)
        assert status == 200 and json.loads(raw)["choices"][0]["text"] == reference["text"]
        target = thread.cluster.targets[0]
        assert sum(d["chosen_rounds"] for d in target.fusion.snapshot().values()) > 0
        assert set(target.fusion.snapshot()) == {f"{tiny_dir['llama']}@2", "ngram", "suffix", "none"}
        assert target.fusion.deadline_s == EMBEDDED_DRAFT_DEADLINE_S and target.fusion.suffix is not None
        assert [server.table.drafter.stop for server in thread.cluster.draft_servers] == [0.2]
        assert thread.cluster.pipelines[0].servers[0].stats.forwards > 0  # stage 2 verified them
    finally:
        thread.stop()
