"""The star as separate processes on loopback: 1 draft server, 3 target instances,
6 concurrent sessions; then kill -9 the draft server mid-stream and restart it."""

import asyncio
import signal
import subprocess

import pytest

from specctl.bench.processes import free_ports, spawn_role, stop_processes, wait_listening
from specctl.engine.loader import load_model
from specctl.spec.rounds import generate
from specctl.spec.params import SamplingParams
from specctl.verify.client import remote_generate, remote_stats
from tests.conftest import poll_async

PROMPTS = [[5, 9, 13, 2], [7, 8, 9, 10, 7, 8, 9], [100], [42, 43, 44, 45, 46], [1, 2, 3, 1, 2, 3], [250, 3, 77]]


def spawn(*args) -> subprocess.Popen:
    return spawn_role(*args)


@pytest.fixture
def star(tiny_dir):
    procs = []
    draft_port, *target_ports = free_ports(4)
    draft_args = ("draft", "--port", str(draft_port), "--model", f"{tiny_dir['llama']}@2", "--mode", "chain",
                  "--depth", "3", "--dtype", "fp32", "--threads", "1", "--log-level", "warning")
    try:
        procs.append(spawn(*draft_args))
        wait_listening(procs[0], "draft server")
        for port in target_ports:
            procs.append(spawn("verify", "--model", str(tiny_dir["llama"]), "--draft", f"127.0.0.1:{draft_port}",
                               "--port", str(port), "--dtype", "fp32", "--threads", "1", "--log-level", "warning"))
        for proc in procs[1:]:
            wait_listening(proc, "target instance")
        yield {"draft_args": draft_args, "draft_port": draft_port, "target_ports": target_ports, "procs": procs}
    finally:  # also when start-up failed: no process outlives the test
        stop_processes(procs)


async def test_six_sessions_three_targets_then_draft_killed(star, tiny_dir):
    target = load_model("t", tiny_dir["llama"], "fp32")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    reference = [generate(target.decoder, p, params)[0] for p in PROMPTS]
    ports = star["target_ports"]
    results = await asyncio.gather(*(remote_generate("127.0.0.1", ports[i % 3], p, params) for i, p in enumerate(PROMPTS)))
    assert [tokens for tokens, _, _ in results] == reference
    # No round without a draft (the stats say why one ran without).
    assert [(s["drafts"], s["fallback_rounds"]) for _, _, s in results] == [(s["rounds"], 0) for _, _, s in results], results
    assert sum(stats["accepted"] for _, _, stats in results) > 0
    # CLOSE reaches the draft server just after DONE reaches the client.
    draft_stats = await poll_async(lambda: remote_stats("127.0.0.1", star["draft_port"]), lambda s: s["sessions"] == 0)
    assert draft_stats["rounds"] > 0 and draft_stats["kv_used_mb"] == 0

    # kill -9 the draft server while 4 sessions run: all finish, identical to plain greedy.
    long_params = SamplingParams(max_tokens=120, ignore_eos=True)
    long_reference = [generate(target.decoder, p, long_params)[0] for p in PROMPTS[:4]]
    started = asyncio.Event()
    runs = [asyncio.create_task(remote_generate("127.0.0.1", ports[i % 3], p, long_params, lambda t: started.set()))
            for i, p in enumerate(PROMPTS[:4])]
    await started.wait()
    star["procs"][0].send_signal(signal.SIGKILL)
    star["procs"][0].wait()
    assert [tokens for tokens, _, _ in await asyncio.gather(*runs)] == long_reference
    fallback = [await remote_stats("127.0.0.1", port) for port in ports]
    assert not any(s["draft_connected"] for s in fallback)

    # Restart it: the targets reconnect and acceptance resumes (visible in stats).
    star["procs"][0] = spawn(*star["draft_args"])
    wait_listening(star["procs"][0], "draft server")
    async def all_stats():
        return [await remote_stats("127.0.0.1", port) for port in ports]

    await poll_async(all_stats, lambda stats: all(s["draft_connected"] for s in stats))
    before = [s["drafts"] for s in await all_stats()]
    again = await asyncio.gather(*(remote_generate("127.0.0.1", port, PROMPTS[0], params) for port in ports))
    assert all(tokens == reference[0] for tokens, _, _ in again)
    after = [s["drafts"] for s in await all_stats()]
    assert all(a > b for a, b in zip(after, before))
    assert (await remote_stats("127.0.0.1", star["draft_port"]))["rounds"] > 0


async def test_a_suffix_draft_server_process_drafts_a_repeated_request_from_the_first(tiny_dir):
    """`specctl draft --mode suffix` (no draft weights) and a target: exact output, and the
    second run of a prompt is drafted from the first's output, its last round included."""
    draft_port, target_port = free_ports(2)
    procs = []
    try:
        procs.append(spawn("draft", "--port", str(draft_port), "--model", str(tiny_dir["llama"]), "--mode", "suffix",
                           "--depth", "4", "--log-level", "warning"))
        wait_listening(procs[0], "draft server")
        procs.append(spawn("verify", "--model", str(tiny_dir["llama"]), "--draft", f"127.0.0.1:{draft_port}",
                           "--port", str(target_port), "--dtype", "fp32", "--threads", "1", "--log-level", "warning"))
        wait_listening(procs[1], "target instance")
        target = load_model("t", tiny_dir["llama"], "fp32")
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        reference = generate(target.decoder, PROMPTS[0], params)[0]
        first = await remote_generate("127.0.0.1", target_port, PROMPTS[0], params)
        await poll_async(lambda: remote_stats("127.0.0.1", draft_port), lambda s: s["sessions"] == 0)
        again = await remote_generate("127.0.0.1", target_port, PROMPTS[0], params)
        assert first[0] == again[0] == reference
        assert again[2]["accepted"] >= first[2]["accepted"] + 12, (first[2], again[2])
    finally:
        stop_processes(procs)


def test_emulated_star_benchmarks_lower_the_targets_priority():
    from specctl.bench.star import StarBenchSettings

    emulated = StarBenchSettings("d", "t", (1, 2), 4, 64, 180.0, "fp32")
    assert emulated.target_niceness == 10  # their compute stands for other machines'
    assert StarBenchSettings("d", "t", (1,), 4, 64, 0.0, "fp32").target_niceness == 0  # bench net: same footing
