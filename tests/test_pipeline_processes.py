"""A pipelined target as separate processes on loopback (`specctl verify --stage i/2`,
the same command on every box) with a draft server: exact output; kill -9 the last stage
mid-stream (the session ends with a clear error), restart it (new sessions work without
restarting the others)."""

import asyncio
from dataclasses import replace
import signal

import pytest

from specctl.bench.processes import free_ports, spawn_role, stop_processes, wait_listening
from specctl.engine.loader import load_model
from specctl.spec.rounds import generate
from specctl.spec.params import SamplingParams
from specctl.verify.client import RemoteError, remote_generate, remote_stats
from tests.conftest import poll_async

PROMPT = [5, 9, 13, 2]


def draft_server(tiny_dir, port: int, mode: str):
    return spawn_role("draft", "--port", str(port), "--model", f"{tiny_dir['llama']}@2", "--mode", mode, "--depth", "4",
                      "--dtype", "fp32", "--threads", "1", "--log-level", "warning")


def stage_args(tiny_dir, index: int, pipeline: str, *extra: str) -> tuple[str, ...]:
    return ("verify", "--stage", f"{index}/2", "--pipeline", pipeline, "--model", str(tiny_dir["llama"]),
            "--dtype", "fp32", "--threads", "1", "--log-level", "warning", *extra)


@pytest.mark.slow
async def test_two_stage_processes_with_a_draft_server_then_the_last_stage_killed_and_restarted(tiny_dir):
    draft_port, first_port, second_port = free_ports(3)
    pipeline = f"127.0.0.1:{first_port},127.0.0.1:{second_port}"
    procs = []
    try:
        procs.append(draft_server(tiny_dir, draft_port, "tree"))
        wait_listening(procs[0], "draft server")
        procs.append(spawn_role(*stage_args(tiny_dir, 2, pipeline)))
        wait_listening(procs[1], "stage 2")
        procs.append(spawn_role(*stage_args(tiny_dir, 1, pipeline, "--draft", f"127.0.0.1:{draft_port}")))
        wait_listening(procs[2], "stage 1")

        target = load_model("t", tiny_dir["llama"], "fp32")
        params = SamplingParams(max_tokens=32, ignore_eos=True)
        reference = generate(target.decoder, PROMPT, params)[0]
        tokens, _, stats = await remote_generate("127.0.0.1", first_port, PROMPT, params)
        assert tokens == reference and stats["drafts"] > 0
        assert (await remote_stats("127.0.0.1", first_port))["pipeline_connected"] is True

        # kill -9 the last stage while a long session streams: it ends with a clear error.
        started = asyncio.Event()
        running = asyncio.create_task(remote_generate("127.0.0.1", first_port, PROMPT,
                                                      SamplingParams(max_tokens=400, ignore_eos=True),
                                                      lambda t: started.set()))
        await started.wait()
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        with pytest.raises(RemoteError, match="generation failed: the pipeline") as failed:
            await running
        assert failed.value.code == "unavailable"
        with pytest.raises(RemoteError, match="pipeline"):
            await remote_generate("127.0.0.1", first_port, PROMPT, params)

        # Restart it alone: stage 1 rebuilds the chain; the output is exact again.
        procs[1] = spawn_role(*stage_args(tiny_dir, 2, pipeline))
        wait_listening(procs[1], "stage 2")
        await poll_async(lambda: remote_stats("127.0.0.1", first_port), lambda s: s["pipeline_connected"])
        tokens, _, stats = await remote_generate("127.0.0.1", first_port, PROMPT, params)
        assert tokens == reference and stats["drafts"] > 0
    finally:
        stop_processes(procs)


@pytest.mark.slow  # 17 s of processes; in-thread SpecPipe pipelines are tested in the default run
async def test_stage_one_serving_specpipe_is_exact_and_a_cancelled_request_frees_every_stage(tiny_dir):
    first_port, second_port = free_ports(2)
    pipeline = f"127.0.0.1:{first_port},127.0.0.1:{second_port}"
    procs = []
    try:
        procs.append(spawn_role(*stage_args(tiny_dir, 2, pipeline)))
        wait_listening(procs[0], "stage 2")
        procs.append(spawn_role(*stage_args(tiny_dir, 1, pipeline, "--specpipe-draft", f"{tiny_dir['llama']}@2",
                                            "--width", "3")))
        wait_listening(procs[1], "stage 1")
        target = load_model("t", tiny_dir["llama"], "fp32")
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        for prompt in (PROMPT, [7, 8, 9, 10, 7, 8, 9]):
            tokens, reason, stats = await remote_generate("127.0.0.1", first_port, prompt, params)
            assert tokens == generate(target.decoder, prompt, params)[0] and reason == "length"
            assert stats["rounds"] == 39
        # A request with a Predicted Output: its chains grafted onto the tree.
        alone = generate(target.decoder, PROMPT, params)[0]
        tokens, _, stats = await remote_generate("127.0.0.1", first_port, PROMPT,
                                                 replace(params, prediction=tuple(alone[:20]) + (1, 2)))
        assert tokens == alone and stats["prediction_accepted"] >= 16
        # A client that goes away mid-stream: its session ends on stage 1 and on stage 2.
        started = asyncio.Event()
        running = asyncio.create_task(remote_generate("127.0.0.1", first_port, PROMPT,
                                                      SamplingParams(max_tokens=400, ignore_eos=True),
                                                      lambda t: started.set()))
        await started.wait()
        running.cancel()
        # the stages' stats are the last ones their heartbeat or a poll asked for (up to 2 s old):
        # wait for ones that have seen the four sessions open and close
        stats = await poll_async(lambda: remote_stats("127.0.0.1", first_port),
                                 lambda s: s["sessions"] == 0 and s["kv_used_mb"] == 0 and s["stages"]
                                 and s["stages"][0]["sessions"] == 0 and s["stages"][0]["sessions_closed"] >= 4)
        assert stats["stages"][0]["sessions_opened"] == stats["stages"][0]["sessions_closed"] == 4
        assert stats["specpipe_steps"] >= 118 and stats["specpipe_hits"] + stats["specpipe_flushes"] <= stats["specpipe_steps"]
    finally:
        stop_processes(procs)


@pytest.mark.slow  # the same in one process: tests/test_specpipe_remote.py
async def test_stage_one_serving_specpipe_with_levels_from_a_draft_server_process_is_exact(tiny_dir):
    draft_port, first_port, second_port = free_ports(3)
    pipeline = f"127.0.0.1:{first_port},127.0.0.1:{second_port}"
    procs = []
    try:
        procs.append(draft_server(tiny_dir, draft_port, "chain"))
        procs.append(spawn_role(*stage_args(tiny_dir, 2, pipeline)))
        wait_listening(procs[0], "draft server")
        wait_listening(procs[1], "stage 2")
        procs.append(spawn_role(*stage_args(tiny_dir, 1, pipeline, "--draft", f"127.0.0.1:{draft_port}",
                                            "--specpipe", "--width", "3")))
        wait_listening(procs[2], "stage 1")
        target = load_model("t", tiny_dir["llama"], "fp32")
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        tokens, reason, _ = await remote_generate("127.0.0.1", first_port, PROMPT, params)
        assert tokens == generate(target.decoder, PROMPT, params)[0] and reason == "length"
        stats = await remote_stats("127.0.0.1", first_port)
        assert stats["specpipe_steps"] == 40 and stats["specpipe_hits"] > 0 and stats["specpipe_draft_lost"] == 0
        draft = await poll_async(lambda: remote_stats("127.0.0.1", draft_port), lambda s: s["level_sessions"] == 0)
        assert draft["levels_sent"] > 0
    finally:
        stop_processes(procs)
